#include "llama-experts-on-disk.h"

#include "llama-context.h"
#include "llama-model.h"

#include "ggml.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#ifdef __linux__
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace {

size_t page_size() {
#ifdef __linux__
    static const size_t size = (size_t) sysconf(_SC_PAGESIZE);
    return size;
#else
    return 4096;
#endif
}

// one expert's bytes of a [.., .., n_expert] weight, widened to whole pages
struct span {
    uint8_t * begin;
    size_t    size;
};

span expert_span(const ggml_tensor * w, int expert) {
    const size_t page = page_size();
    const uintptr_t first = (uintptr_t) w->data + (size_t) expert * w->nb[2];
    const uintptr_t begin = first & ~(uintptr_t) (page - 1);
    const uintptr_t end   = (first + w->nb[2] + page - 1) & ~(uintptr_t) (page - 1);
    return { (uint8_t *) begin, (size_t) (end - begin) };
}

// bytes of the span not in memory (mincore: 1 byte per page, bit 0 set when resident)
size_t span_missing(const span & s) {
#ifdef __linux__
    const size_t page = page_size();
    std::vector<unsigned char> in_core(s.size / page);
    if (mincore(s.begin, s.size, in_core.data()) != 0) {
        return s.size; // cannot tell: count it as read
    }
    size_t missing = 0;
    for (unsigned char c : in_core) {
        missing += (c & 1) ? 0 : page;
    }
    return missing;
#else
    (void) s;
    return 0;
#endif
}

void span_advise(const span & s, int advice) {
#ifdef __linux__
    if (advice == SPAC_DISK_READ) {
        // the kernel reads the range in the background, but one call reads at most the device's
        // read-ahead window or its largest request (read_ahead_kb, max_sectors_kb; 128 KiB by
        // default on many disks): the rest of a longer range would be faulted in page by page
        // (the mapping is MADV_RANDOM), at a tenth of the rate. 128 KiB calls read it all
        constexpr size_t chunk = 128 * 1024;
        for (size_t off = 0; off < s.size; off += chunk) {
            madvise(s.begin + off, std::min(chunk, s.size - off), MADV_WILLNEED);
        }
        return;
    }
    // the pages go to the inactive list, reclaimed first when memory is wanted (Linux 5.4+): not
    // reclaimed here, on the loop's thread (MADV_PAGEOUT cost a run 17% of its decode time)
#ifdef MADV_COLD
    if (madvise(s.begin, s.size, MADV_COLD) == 0) {
        return;
    }
#endif
    madvise(s.begin, s.size, MADV_DONTNEED);
#else
    (void) s;
    (void) advice;
#endif
}

} // namespace

llama_experts_on_disk::llama_experts_on_disk(const llama_model & model) {
    layers.resize(model.layers.size());
    for (size_t il = 0; il < model.layers.size(); ++il) {
        const auto & src = model.layers[il];
        layer & l = layers[il];
        l.il   = (int) il;
        l.disk = this;
        for (const ggml_tensor * w : { src.ffn_up_exps, src.ffn_gate_exps, src.ffn_down_exps, src.ffn_gate_up_exps }) {
            if (w != nullptr && w->data != nullptr) {
                l.weights.push_back(w);
                n_expert = std::max(n_expert, (int32_t) w->ne[2]);
            }
        }
    }
    moe_layers = llama_moe_layers(model);
    for (size_t m = 0; m < moe_layers.size(); ++m) {
        layers[moe_layers[m]].moe = (int) m;
    }
}

void llama_experts_on_disk::set_on_device(const uint8_t * mask) {
    std::lock_guard<std::mutex> lock(on_device_mutex);
    if (mask == nullptr) {
        on_device.clear();
    } else {
        on_device.assign(mask, mask + moe_layers.size() * (size_t) n_expert);
    }
}

bool llama_experts_on_disk::valid(int il, int expert) const {
    return il >= 0 && il < (int) layers.size() && !layers[il].weights.empty() && expert >= 0 &&
           expert < (int) layers[il].weights[0]->ne[2];
}

int64_t llama_experts_on_disk::missing_bytes(int il, int expert) const {
    if (!valid(il, expert)) {
        return -1;
    }
    size_t missing = 0;
    for (const ggml_tensor * w : layers[il].weights) {
        missing += span_missing(expert_span(w, expert));
    }
    return (int64_t) missing;
}

bool llama_experts_on_disk::advise(int il, int expert, int advice) {
    if (!valid(il, expert) || (advice != SPAC_DISK_READ && advice != SPAC_DISK_DROP)) {
        return false;
    }
    if (advice == SPAC_DISK_READ) {
        const int64_t missing = missing_bytes(il, expert);
        if (missing == 0) {
            return true;
        }
        n_read_ahead++;
        bytes_read_ahead += (uint64_t) missing;
    } else {
        n_dropped++;
    }
    for (const ggml_tensor * w : layers[il].weights) {
        span_advise(expert_span(w, expert), advice);
    }
    return true;
}

void llama_experts_on_disk::gate_layer(const layer & l, const int32_t * ids, int64_t n, int ith, int nth) {
    // each chosen expert once, whatever the number of tokens that chose it; every read is asked for
    // before the layer waits on any of them. The k-th expert is thread k % nth's: in a memory limit
    // MADV_WILLNEED reclaims the pages it charges on the caller's thread (a fifth of a limited
    // decode's samples), and the graph's other threads would wait for one
    std::vector<bool> seen(l.weights[0]->ne[2], false);
    {
        std::lock_guard<std::mutex> lock(on_device_mutex);
        if (!on_device.empty() && l.moe >= 0) { // the device computes these: not read here
            for (size_t e = 0; e < seen.size(); ++e) {
                seen[e] = on_device[(size_t) l.moe * n_expert + e] != 0;
            }
        }
    }
    int64_t k = 0;
    for (int64_t i = 0; i < n; ++i) {
        const int32_t e = ids[i];
        if (e < 0 || e >= (int32_t) seen.size() || seen[e]) {
            continue;
        }
        seen[e] = true;
        if (k++ % nth != ith) {
            continue;
        }
        n_gate_experts++;
        const int64_t missing = missing_bytes(l.il, e);
        if (missing > 0) {
            n_stalls++;
            bytes_stalled += (uint64_t) missing;
            const auto start = std::chrono::steady_clock::now();
            for (const ggml_tensor * w : l.weights) {
                span_advise(expert_span(w, e), SPAC_DISK_READ);
            }
            gate_advise_ns += (uint64_t) std::chrono::duration_cast<std::chrono::nanoseconds>(
                std::chrono::steady_clock::now() - start).count();
        }
    }
}

ggml_tensor * llama_experts_on_disk::gate(ggml_context * ctx, ggml_tensor * selected, int il) {
    if (il < 0 || il >= (int) layers.size() || layers[il].weights.empty()) {
        return selected;
    }
    return ggml_map_custom1(ctx, ggml_cont(ctx, selected), [](ggml_tensor * dst, const ggml_tensor * a, int ith, int nth, void * ud) {
        if (ith == 0) {
            memcpy(dst->data, a->data, ggml_nbytes(a));
        }
        const auto * l = (const layer *) ud;
        l->disk->gate_layer(*l, (const int32_t *) a->data, ggml_nelements(a), ith, nth);
    }, GGML_N_TASKS_MAX, &layers[il]);
}

void llama_experts_on_disk::get_stats(spac_disk_stats & out) const {
    out.n_gate_experts   = n_gate_experts;
    out.n_stalls         = n_stalls;
    out.bytes_stalled    = bytes_stalled;
    out.n_read_ahead     = n_read_ahead;
    out.bytes_read_ahead = bytes_read_ahead;
    out.n_dropped        = n_dropped;
    out.gate_advise_ns   = gate_advise_ns;
}

void llama_experts_on_disk::reset_stats() {
    n_gate_experts = n_stalls = bytes_stalled = 0;
    n_read_ahead = bytes_read_ahead = n_dropped = gate_advise_ns = 0;
}
