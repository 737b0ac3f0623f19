#include "llama-experts-on-disk.h"

#include "llama-context.h"
#include "llama-model.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <cstdlib>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#ifdef __linux__
#include <sys/mman.h>
#include <unistd.h>
#include <fcntl.h>
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
    if (const char * v = getenv("SPAC_DISK_DIRECT")) {
        direct_max = atoi(v);
        if (direct_max > 0 && !direct_init()) {
            fprintf(stderr, "spac: SPAC_DISK_DIRECT: setup failed\n");
            abort();
        }
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
    {
        std::lock_guard<std::mutex> lk(dmu);
        io_stop = true;
    }
    cv_io.notify_all();
    for (auto & t : io) {
        t.join();
    }
    if (pipe) {
        ggml_cpu_set_expert_wait(nullptr, nullptr);
    }
    if (direct_fd >= 0) {
        fprintf(stderr, "spac: SPAC_DISK_DIRECT: gate experts %llu, stalls %llu, already in flight %llu, guesses read %llu\n",
                (unsigned long long) n_gate_experts.load(), (unsigned long long) n_stalls.load(),
                (unsigned long long) n_wait_in_flight, (unsigned long long) n_read_next.load());
        close(direct_fd);
    }
}

size_t llama_experts_on_disk::expert_bytes(int il) const {
    size_t n = 0;
    for (const ggml_tensor * w : layers[il].weights) {
        n += w->nb[2];
    }
    return n;
}

bool llama_experts_on_disk::direct_init() {
    // the mapping that holds the experts: its file and where file offset 0 would be
    const ggml_tensor * any = nullptr;
    for (const auto & l : layers) {
        if (!l.weights.empty()) { any = l.weights[0]; break; }
    }
    if (any == nullptr) return false;
    const uintptr_t a = (uintptr_t) any->data;
    std::ifstream maps("/proc/self/maps");
    std::string line, path;
    while (std::getline(maps, line)) {
        uintptr_t lo, hi; unsigned long long off; char perms[8], dev[16]; unsigned long ino;
        char file[1024] = {0};
        if (sscanf(line.c_str(), "%lx-%lx %7s %llx %15s %lu %1023s", &lo, &hi, perms, &off, dev, &ino, file) >= 6 &&
            a >= lo && a < hi) {
            direct_base = lo - (uintptr_t) off;
            path = file;
            break;
        }
    }
    if (path.empty()) return false;
    direct_fd = open(path.c_str(), O_RDONLY | O_DIRECT);
    if (direct_fd < 0) return false;
    const size_t page = page_size();
    dstate.assign(layers.size(), std::vector<int8_t>(n_expert, 0));
    dpending.assign(layers.size(), std::vector<int32_t>(n_expert, 0));
    dwpending.assign(layers.size(), std::vector<int32_t>((size_t) n_expert * MAX_W, 0));
    for (const auto & l : layers) {
        for (size_t w = 0; w < l.weights.size(); ++w) {
            weight_of[l.weights[w]] = { l.il, (int) w };
        }
    }
    if (getenv("SPAC_DISK_PIPE") != nullptr && atoi(getenv("SPAC_DISK_PIPE")) > 0) {
        pipe = true;
        ggml_cpu_set_expert_wait(expert_wait, this);
    }
    dlast.assign(layers.size(), std::vector<uint64_t>(n_expert, 0));
    for (const auto & l : layers) {
        for (const ggml_tensor * w : l.weights) {
            const uintptr_t b = (uintptr_t) w->data & ~(uintptr_t) (page - 1);
            const uintptr_t e = ((uintptr_t) w->data + ggml_nbytes(w) + page - 1) & ~(uintptr_t) (page - 1);
            // the first and last pages may hold another tensor's bytes: kept from the file
            std::vector<uint8_t> head(page), tail(page);
            memcpy(head.data(), (void *) b, page);
            memcpy(tail.data(), (void *) (e - page), page);
            if (mmap((void *) b, e - b, PROT_READ | PROT_WRITE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) == MAP_FAILED) {
                return false;
            }
            memcpy((void *) b, head.data(), page);
            memcpy((void *) (e - page), tail.data(), page);
        }
    }
    for (int i = 0; i < 16; ++i) {
        io.emplace_back([this] { io_loop(); });
    }
    fprintf(stderr, "spac: SPAC_DISK_DIRECT: %d experts at most, O_DIRECT reads of %s\n", direct_max, path.c_str());
    return true;
}

void llama_experts_on_disk::io_loop() {
    for (;;) {
        chunk c;
        {
            std::unique_lock<std::mutex> lk(dmu);
            cv_io.wait(lk, [&] { return io_stop || !queue.empty(); });
            if (io_stop) return;
            c = queue.front();
            queue.pop_front();
        }
        size_t done = 0;
        while (done < c.len) {
            const ssize_t r = pread(direct_fd, c.dst + done, c.len - done, (off_t) (c.off + done));
            if (r <= 0) break; // end of file (the last page)
            done += (size_t) r;
        }
        {
            std::lock_guard<std::mutex> lk(dmu);
            dwpending[c.il][(size_t) c.e * MAX_W + c.w]--;
            if (--dpending[c.il][c.e] == 0 && dstate[c.il][c.e] == 1) {
                dstate[c.il][c.e] = 2;
            }
        }
        cv_done.notify_all();
    }
}

void llama_experts_on_disk::direct_make_room_locked() {
    // the least recently used resident expert (the gate's own and the guesses were just used)
    while (dresident >= direct_max) {
        int bi = -1, be = -1;
        for (size_t il2 = 0; il2 < dstate.size(); ++il2) {
            for (int e2 = 0; e2 < n_expert && !dstate[il2].empty(); ++e2) {
                if (dstate[il2][e2] == 2 && dlast[il2][e2] < dclock && (bi < 0 || dlast[il2][e2] < dlast[bi][be])) {
                    bi = (int) il2; be = e2;
                }
            }
        }
        if (bi < 0) {
            return;
        }
        direct_drop_locked(bi, be);
    }
}

void llama_experts_on_disk::direct_read_locked(int il, const std::vector<int> & experts, bool first) {
    // weight by weight (the order the layer's matmuls take them), each weight's experts in the given
    // order: the first matmul can start on the first expert while the rest arrive
    static const size_t CHUNK = (size_t) atoi(getenv("SPAC_DIRECT_CHUNK_KB") ? getenv("SPAC_DIRECT_CHUNK_KB") : "1024") << 10;
    std::vector<chunk> chunks;
    for (size_t w = 0; w < layers[il].weights.size(); ++w) {
        for (int e : experts) {
            const span s = expert_span(layers[il].weights[w], e);
            for (size_t off = 0; off < s.size; off += CHUNK) {
                uint8_t * dst = s.begin + off;
                chunks.push_back({ (uint64_t) ((uintptr_t) dst - direct_base), dst, std::min(CHUNK, s.size - off), il, e, (int) w });
                dpending[il][e]++;
                dwpending[il][(size_t) e * MAX_W + w]++;
            }
        }
    }
    if (first) {
        queue.insert(queue.begin(), chunks.begin(), chunks.end());
    } else {
        queue.insert(queue.end(), chunks.begin(), chunks.end());
    }
    for (int e : experts) {
        dstate[il][e] = 1;
        dresident++;
    }
    cv_io.notify_all();
}

void llama_experts_on_disk::expert_wait(const ggml_tensor * w, int64_t expert, void * ud) {
    auto * self = (llama_experts_on_disk *) ud;
    const auto it = self->weight_of.find(w);
    if (it == self->weight_of.end()) {
        return;  // not an expert weight read from the disk
    }
    const int il = it->second.first, wi = it->second.second;
    std::unique_lock<std::mutex> lk(self->dmu);
    if (self->dstate[il][expert] == 0) {
        fprintf(stderr, "spac: SPAC_DISK_PIPE: layer %d expert %lld computed and never read\n", il, (long long) expert);
        abort();
    }
    self->cv_done.wait(lk, [&] { return self->dwpending[il][(size_t) expert * MAX_W + wi] == 0; });
}

void llama_experts_on_disk::direct_drop_locked(int il, int e) {
    const size_t page = page_size();
    for (const ggml_tensor * w : layers[il].weights) {
        // the pages wholly inside the expert: its neighbours' bytes stay
        const uintptr_t first = (uintptr_t) w->data + (size_t) e * w->nb[2];
        const uintptr_t b = (first + page - 1) & ~(uintptr_t) (page - 1);
        const uintptr_t end = (first + w->nb[2]) & ~(uintptr_t) (page - 1);
        if (end > b) {
            madvise((void *) b, end - b, MADV_DONTNEED);
        }
    }
    dstate[il][e] = 0;
    dresident--;
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
    if (direct_max > 0) {
        return dstate[il][expert] == 2 ? 0 : (int64_t) expert_bytes(il);
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
    if (direct_max > 0) {
        std::lock_guard<std::mutex> lk(dmu);
        if (advice == SPAC_DISK_READ && dstate[il][expert] == 0 && dresident < direct_max) {
            n_read_ahead++;
            bytes_read_ahead += expert_bytes(il);
            direct_read_locked(il, std::vector<int>{ expert }, false);
        } else if (advice == SPAC_DISK_DROP && dstate[il][expert] == 2) {
            n_dropped++;
            direct_drop_locked(il, expert);
        }
        return true;
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

void llama_experts_on_disk::gate_layer(const layer & l, const int32_t * ids, int64_t n, const ggml_tensor * logits, int ith, int nth) {
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
    if (direct_max > 0) {
        if (ith != 0) {
            return;
        }
        const auto start = std::chrono::steady_clock::now();
        std::unique_lock<std::mutex> lk(dmu);
        std::vector<int> want;
        const uint64_t now = ++dclock;
        for (int64_t i = 0; i < n; ++i) {
            const int32_t e = ids[i];
            if (e < 0 || e >= (int32_t) seen.size() || seen[e]) continue;
            seen[e] = true;
            n_gate_experts++;
            dlast[l.il][e] = now;
            want.push_back(e);
        }
        std::vector<int> missing;
        for (int e : want) {
            if (dstate[l.il][e] != 0) {
                if (dstate[l.il][e] == 1) {
                    n_wait_in_flight++;
                }
                continue;
            }
            direct_make_room_locked();
            n_stalls++;
            bytes_stalled += expert_bytes(l.il);
            missing.push_back(e);
        }
        if (!missing.empty()) {
            // each thread computes a run of the layer's experts in id order: read every run's first
            // expert first, then every run's second, so that no thread waits for the others' experts
            std::vector<int> all = want;
            std::sort(all.begin(), all.end());
            const int k = (int) all.size();
            std::vector<std::pair<int, int>> key;  // (place in its thread's run, thread) per missing expert
            for (int e : missing) {
                const int i = (int) (std::lower_bound(all.begin(), all.end(), e) - all.begin());
                const int owner = (int) ((int64_t) i * nth / k);
                const int run_start = (int) ((owner * (int64_t) k + nth - 1) / nth);
                key.push_back({ i - run_start, owner });
            }
            std::vector<int> order(missing.size());
            for (size_t i = 0; i < order.size(); ++i) order[i] = (int) i;
            std::sort(order.begin(), order.end(), [&](int a, int b) { return key[a] < key[b]; });
            std::vector<int> ordered;
            for (int i : order) ordered.push_back(missing[i]);
            direct_read_locked(l.il, ordered, true);
        }
        if (logits != nullptr && l.next != nullptr) {
            direct_guess_locked(rank_next_layer(l, logits));
        }
        if (!pipe) {
            cv_done.wait(lk, [&] {
                for (int e : want) if (dstate[l.il][e] != 2) return false;
                return true;
            });
        }
        gate_advise_ns += (uint64_t) std::chrono::duration_cast<std::chrono::nanoseconds>(
            std::chrono::steady_clock::now() - start).count();
        return;
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
    std::vector<std::pair<int, int32_t>> guesses = rank_next_layer(l, logits);
    {
        std::lock_guard<std::mutex> lock(reader_mutex);
        reader_queue = std::move(guesses);
        if (!reader.joinable()) {
            reader = std::thread([this] { reader_loop(); });
        }
    }
    reader_wake.notify_one();
}

std::vector<std::pair<int, int32_t>> llama_experts_on_disk::rank_next_layer(const layer & l, const ggml_tensor * logits) {
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
    return guesses;
}

void llama_experts_on_disk::direct_guess_locked(const std::vector<std::pair<int, int32_t>> & guesses) {
    // the tier's own memory: the guesses are read by the io threads, behind any gate's reads. They
    // share the gate's clock, so that making room for them drops neither them nor the gate's own
    const uint64_t now = dclock;
    for (const auto & g : guesses) {
        dlast[g.first][g.second] = now; // a guess is not what room is made from
    }
    for (const auto & g : guesses) {
        if (dstate[g.first][g.second] != 0) {
            continue;
        }
        direct_make_room_locked();
        if (dresident >= direct_max) {
            break;
        }
        n_read_next++;
        bytes_read_next += expert_bytes(g.first);
        direct_read_locked(g.first, std::vector<int>{ g.second }, false);
    }
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


void llama_experts_on_disk::run_gate(ggml_tensor * dst, const ggml_tensor * ids, const ggml_tensor * logits,
                                     int ith, int nth, void * ud) {
    const auto * l = (const layer *) ud;
    if (ith == 0) {
        memcpy(dst->data, ids->data, ggml_nbytes(ids));
    }
    const bool next = logits != nullptr && l->disk->read_next.load(std::memory_order_relaxed) > 0;
    l->disk->gate_layer(*l, (const int32_t *) ids->data, ggml_nelements(ids), next && l->disk->direct_max > 0 ? logits : nullptr, ith, nth);
    if (next && l->disk->direct_max == 0) {
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
