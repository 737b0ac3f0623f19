#include "llama-experts-on-disk.h"

#include "llama-context.h"
#include "llama-model.h"

#include "ggml.h"
#include "ggml-backend.h"

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
        // the read of the next layer computes on the host (in any of the CPU's layouts): a router on
        // a device would add a crossing
        const ggml_tensor * r = src.ffn_gate_inp;
        ggml_backend_dev_t dev = r != nullptr && r->buffer != nullptr ? ggml_backend_buft_get_device(ggml_backend_buffer_get_type(r->buffer)) : nullptr;
        const bool on_host = dev != nullptr ? ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU
                                            : r != nullptr && r->buffer != nullptr && ggml_backend_buffer_is_host(r->buffer); // a mapped file's
        if (r != nullptr && r->data != nullptr && on_host) {
            l.router = r;
        }
    }
    moe_layers = llama_moe_layers(model);
    for (size_t m = 0; m < moe_layers.size(); ++m) {
        layers[moe_layers[m]].moe = (int) m;
        if (m + 1 < moe_layers.size() && !layers[moe_layers[m + 1]].weights.empty()) {
            layers[moe_layers[m]].next = &layers[moe_layers[m + 1]];
        }
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

void llama_experts_on_disk::read_next_layer(const layer & l, const ggml_tensor * logits, int ith, int nth) {
    // one thread ranks: the union of each token's n best, in token order, handed to the reader
    (void) nth;
    if (ith != 0) {
        return;
    }
    const layer & next = *l.next;
    const int64_t n_exp = logits->ne[0];
    const int n_best = (int) std::min<int64_t>(read_next.load(std::memory_order_relaxed), n_exp);
    std::vector<bool> seen(n_exp, false);
    {
        std::lock_guard<std::mutex> lock(on_device_mutex);
        if (!on_device.empty() && next.moe >= 0) {
            for (int64_t e = 0; e < n_exp && e < n_expert; ++e) {
                seen[e] = on_device[(size_t) next.moe * n_expert + e] != 0;
            }
        }
    }
    std::vector<std::pair<int, int32_t>> guesses;
    std::vector<int32_t> order(n_exp);
    for (int64_t t = 0; t < logits->ne[1]; ++t) {
        const float * x = (const float *) ((const char *) logits->data + t * logits->nb[1]);
        for (int64_t e = 0; e < n_exp; ++e) {
            order[e] = (int32_t) e;
        }
        std::partial_sort(order.begin(), order.begin() + n_best, order.end(),
                          [x](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); });
        for (int i = 0; i < n_best; ++i) {
            if (!seen[order[i]]) {
                seen[order[i]] = true;
                guesses.emplace_back(next.il, order[i]);
            }
        }
    }
    {
        std::lock_guard<std::mutex> lock(reader_mutex);
        reader_queue = std::move(guesses);
        if (!reader.joinable()) {
            reader = std::thread([this] { reader_loop(); });
        }
    }
    reader_wake.notify_one();
}

void llama_experts_on_disk::reader_loop() {
    std::unique_lock<std::mutex> lock(reader_mutex);
    while (true) {
        reader_wake.wait(lock, [this] { return reader_stop || !reader_queue.empty(); });
        if (reader_stop) {
            return;
        }
        const auto [il, e] = reader_queue.front();
        reader_queue.erase(reader_queue.begin());
        lock.unlock();
        const int64_t missing = missing_bytes(il, e);
        if (missing > 0) {
            n_read_next++;
            bytes_read_next += (uint64_t) missing;
            const auto start = std::chrono::steady_clock::now();
            for (const ggml_tensor * w : layers[il].weights) {
                span_advise(expert_span(w, e), SPAC_DISK_READ);
            }
            read_next_ns += (uint64_t) std::chrono::duration_cast<std::chrono::nanoseconds>(
                std::chrono::steady_clock::now() - start).count();
        }
        lock.lock();
    }
}

llama_experts_on_disk::~llama_experts_on_disk() {
    {
        std::lock_guard<std::mutex> lock(reader_mutex);
        reader_stop = true;
    }
    reader_wake.notify_one();
    if (reader.joinable()) {
        reader.join();
    }
}

void llama_experts_on_disk::run_gate(ggml_tensor * dst, const ggml_tensor * ids, const ggml_tensor * logits,
                                     int ith, int nth, void * ud) {
    const auto * l = (const layer *) ud;
    if (ith == 0) {
        memcpy(dst->data, ids->data, ggml_nbytes(ids));
    }
    l->disk->gate_layer(*l, (const int32_t *) ids->data, ggml_nelements(ids), ith, nth);
    if (logits != nullptr && l->disk->read_next.load(std::memory_order_relaxed) > 0) {
        l->disk->read_next_layer(*l, logits, ith, nth);
    }
}

ggml_tensor * llama_experts_on_disk::gate(ggml_context * ctx, ggml_tensor * selected, ggml_tensor * cur, int il) {
    if (il < 0 || il >= (int) layers.size() || layers[il].weights.empty()) {
        return selected;
    }
    layer & l = layers[il];
    ggml_tensor * ids = ggml_cont(ctx, selected);
    // the next layer's logits are in the graph whether the read is on or not (switching it keeps the
    // graph's shape): one small matmul of a host weight per layer
    if (cur != nullptr && l.next != nullptr && l.next->router != nullptr && l.next->router->ne[0] == cur->ne[0]) {
        ggml_tensor * logits = ggml_mul_mat(ctx, const_cast<ggml_tensor *>(l.next->router), cur);
        return ggml_map_custom2(ctx, ids, logits, [](ggml_tensor * dst, const ggml_tensor * a, const ggml_tensor * b,
                                                     int ith, int nth, void * ud) { run_gate(dst, a, b, ith, nth, ud); },
                                GGML_N_TASKS_MAX, &l);
    }
    return ggml_map_custom1(ctx, ids, [](ggml_tensor * dst, const ggml_tensor * a, int ith, int nth, void * ud) {
        run_gate(dst, a, nullptr, ith, nth, ud);
    }, GGML_N_TASKS_MAX, &l);
}

void llama_experts_on_disk::get_stats(spac_disk_stats & out) const {
    out.n_gate_experts   = n_gate_experts;
    out.n_stalls         = n_stalls;
    out.bytes_stalled    = bytes_stalled;
    out.n_read_ahead     = n_read_ahead;
    out.bytes_read_ahead = bytes_read_ahead;
    out.n_dropped        = n_dropped;
    out.gate_advise_ns   = gate_advise_ns;
    out.n_read_next      = n_read_next;
    out.bytes_read_next  = bytes_read_next;
    out.read_next_ns     = read_next_ns;
}

void llama_experts_on_disk::reset_stats() {
    n_gate_experts = n_stalls = bytes_stalled = 0;
    n_read_ahead = bytes_read_ahead = n_dropped = gate_advise_ns = 0;
    n_read_next = bytes_read_next = read_next_ns = 0;
}
