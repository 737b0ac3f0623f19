#include "llama-expert-pool.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-mmap.h"
#include "llama-model.h"

#include "ggml-cpu.h"
#include "gguf.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <stdexcept>

static std::array<const ggml_tensor *, LLAMA_EXPERT_N_KINDS> expert_tensors(const llama_layer & layer) {
    std::array<const ggml_tensor *, LLAMA_EXPERT_N_KINDS> t = {};
    t[LLAMA_EXPERT_UP]      = layer.ffn_up_exps;
    t[LLAMA_EXPERT_GATE]    = layer.ffn_gate_exps;
    t[LLAMA_EXPERT_DOWN]    = layer.ffn_down_exps;
    t[LLAMA_EXPERT_GATE_UP] = layer.ffn_gate_up_exps;
    t[LLAMA_EXPERT_UP_B]      = layer.ffn_up_exps_b;
    t[LLAMA_EXPERT_GATE_B]    = layer.ffn_gate_exps_b;
    t[LLAMA_EXPERT_DOWN_B]    = layer.ffn_down_exps_b;
    t[LLAMA_EXPERT_GATE_UP_B] = layer.ffn_gate_up_exps_b;
    t[LLAMA_EXPERT_UP_S]      = layer.ffn_up_exps_s;
    t[LLAMA_EXPERT_GATE_S]    = layer.ffn_gate_exps_s;
    t[LLAMA_EXPERT_DOWN_S]    = layer.ffn_down_exps_s;
    return t;
}

// the expert index is a tensor's last dimension: [.., n_expert]
static int expert_dim(const ggml_tensor * t) {
    return ggml_n_dims(t) - 1;
}

static size_t expert_bytes(const ggml_tensor * t) {
    return t->nb[expert_dim(t)];
}

llama_expert_pool::llama_expert_pool(llama_context & lctx, const spac_engine_params & params) : lctx(lctx) {
    const llama_model & model = lctx.get_model();

    n_expert      = (int32_t) model.hparams.n_expert;
    n_expert_used = (int32_t) model.hparams.n_expert_used_max();
    layer_il      = llama_moe_layers(model);
    if (layer_il.empty() || n_expert <= 0) {
        throw std::runtime_error("the model has no MoE layers: an expert pool needs a Mixture-of-Experts model");
    }
    if (params.model_path == nullptr) {
        throw std::runtime_error("model_path is required: experts are copied from the GGUF file");
    }
    max_split_tokens = params.max_split_tokens > 0 ? params.max_split_tokens : 64;
    if (params.split_graph != SPAC_SPLIT_OVERLAP && params.split_graph != SPAC_SPLIT_PER_MATMUL) {
        throw std::runtime_error("split_graph must be SPAC_SPLIT_OVERLAP or SPAC_SPLIT_PER_MATMUL, got " + std::to_string(params.split_graph));
    }
    if (params.join < SPAC_JOIN_AUTO || params.join > SPAC_JOIN_PARTIAL_SUMS) {
        throw std::runtime_error("join must be one of SPAC_JOIN_AUTO, _PER_EXPERT, _PARTIAL_SUMS, got " + std::to_string(params.join));
    }
    split_graph = params.split_graph;
    if (params.only_half < 0 || params.only_half > 2) {
        throw std::runtime_error("only_half must be 0 (both), 1 (device) or 2 (host), got " + std::to_string(params.only_half));
    }
    only_half = params.only_half;
    no_evict         = params.no_evict;
    copy_delay_us    = std::max(0, params.copy_delay_us);
    copy_batch       = params.copy_batch_experts > 0 ? params.copy_batch_experts : 8;

    // the MoE layers this pool holds: [layer_begin, layer_end) of the model's layers
    const int32_t layer_end = params.layer_end > 0 ? params.layer_end : (int32_t) model.layers.size();
    first_moe = (int32_t) (std::lower_bound(layer_il.begin(), layer_il.end(), params.layer_begin) - layer_il.begin());
    end_moe   = (int32_t) (std::lower_bound(layer_il.begin(), layer_il.end(), layer_end) - layer_il.begin());
    if (params.layer_begin < 0 || first_moe >= end_moe) {
        throw std::runtime_error("layers [" + std::to_string(params.layer_begin) + ", " + std::to_string(layer_end) +
                                 ") hold no MoE layer");
    }

    moe_of_il.assign(model.layers.size(), -1);
    std::map<std::string, int> group_of_signature;
    for (int m = 0; m < (int) layer_il.size(); ++m) {
        const auto & layer = model.layers[layer_il[m]];
        moe_of_il[layer_il[m]] = m;
        host.push_back(expert_tensors(layer));
        if (!owns(m)) {
            layer_group.push_back(-1); // another device's layer (or the host's): no slots here
            continue;
        }

        // layers whose expert tensors agree in type and shape can share slots
        std::string sig;
        for (const ggml_tensor * t : host.back()) {
            sig += t ? std::string(ggml_type_name(t->type)) + ":" + std::to_string(t->ne[0]) + "x" + std::to_string(t->ne[1]) + ";" : "-;";
            if (t && t->ne[expert_dim(t)] != n_expert) {
                throw std::runtime_error(std::string("tensor ") + t->name + " does not hold n_expert experts");
            }
        }
        auto it = group_of_signature.find(sig);
        if (it == group_of_signature.end()) {
            it = group_of_signature.emplace(sig, (int) groups.size()).first;
            groups.emplace_back();
            for (const ggml_tensor * t : host.back()) {
                groups.back().slot_bytes += t ? expert_bytes(t) : 0;
            }
        }
        layer_group.push_back(it->second);
        const auto & kinds = host.back();
        if (params.skip_absent && (kinds[LLAMA_EXPERT_UP_S] || kinds[LLAMA_EXPERT_GATE_S] || kinds[LLAMA_EXPERT_DOWN_S])) {
            throw std::runtime_error("skip_absent does not support per-expert scales (GET_ROWS has no id -1)");
        }
    }

    // device and budget
    if (params.device == nullptr || strcmp(params.device, "CPU") == 0) {
        dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    } else {
        dev = ggml_backend_dev_by_name(params.device);
        if (dev == nullptr) {
            std::string names;
            for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
                names += std::string(i ? ", " : "") + ggml_backend_dev_name(ggml_backend_dev_get(i));
            }
            throw std::runtime_error(std::string("no device named '") + params.device + "' (available: " + names + ")");
        }
        backend = lctx.backend_of(dev);
        if (backend == nullptr) {
            throw std::runtime_error(std::string("device '") + params.device + "' is not used by this context");
        }
        // the copy worker's own backend of the device (on a GPU its own stream): a batch of copies
        // queues back to back and costs one synchronize, and never waits behind the graph's work
        copy_backend = copy_batch > 1 ? ggml_backend_dev_init(dev, nullptr) : nullptr;
        if (copy_batch > 1 && copy_backend == nullptr) {
            LLAMA_LOG_WARN("%s: %s gave the copy worker no backend: every copy waits for itself\n", __func__, params.device);
        }
    }
    // a CPU pool shares the host's kernels and memory: per-expert join, bit-identical to unsplit
    partial_sums = params.join == SPAC_JOIN_AUTO ? backend != nullptr : params.join == SPAC_JOIN_PARTIAL_SUMS;

    std::vector<size_t> layers_in_group(groups.size(), 0);
    for (int g : layer_group) {
        if (g >= 0) {
            layers_in_group[g]++;
        }
    }
    size_t total_bytes = 0;
    for (size_t g = 0; g < groups.size(); ++g) {
        total_bytes += layers_in_group[g] * n_expert * groups[g].slot_bytes;
    }
    double budget = params.budget_bytes > 0 ? (double) params.budget_bytes : (double) params.budget_ratio * (double) total_bytes;
    if (!(budget > 0)) {
        throw std::runtime_error("expert budget must be > 0 (budget_bytes or budget_ratio)");
    }
    size_t mem_free = 0, mem_total = 0;
    ggml_backend_dev_memory(dev, &mem_free, &mem_total);
    if (mem_free > 0 && budget > (double) mem_free) {
        throw std::runtime_error("expert budget of " + std::to_string((uint64_t) budget) + " bytes exceeds the free memory of " +
                                 ggml_backend_dev_name(dev) + " (" + std::to_string(mem_free) + " bytes)");
    }
    const bool skips_absent = ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU || params.skip_absent;
    n_map_positions = skips_absent ? 1 : n_expert_used;
    size_t pool_bytes = 0;
    for (size_t g = 0; g < groups.size(); ++g) {
        // the budget is shared in proportion to each group's expert bytes
        const double share = (double) (layers_in_group[g] * n_expert * groups[g].slot_bytes) / (double) total_bytes;
        // (a budget of every expert's bytes gives every slot, whatever the shares' rounding)
        const int64_t all = (int64_t) layers_in_group[g] * n_expert;
        const int64_t n = budget >= (double) total_bytes ? all : std::min<int64_t>((int64_t) (budget * share / groups[g].slot_bytes), all);
        if (n < 1) {
            throw std::runtime_error("expert budget of " + std::to_string((uint64_t) budget) + " bytes is below one expert slot (" +
                                     std::to_string(groups[g].slot_bytes) + " bytes per expert)");
        }
        groups[g].n_slots = (int32_t) n;
        pool_bytes += (size_t) (n + n_map_positions) * groups[g].slot_bytes; // + the zero slots
    }
    if (mem_free > 0 && pool_bytes > mem_free) {
        throw std::runtime_error("expert pool of " + std::to_string(pool_bytes) + " bytes exceeds the free memory of " +
                                 ggml_backend_dev_name(dev) + " (" + std::to_string(mem_free) + " bytes)");
    }
    // a pool with a slot for every expert is filled at load (below), as llama.cpp loads the layers it
    // offloads: nothing is ever missing, so it needs no staging slots
    holds_all = true;
    for (size_t g = 0; g < groups.size(); ++g) {
        holds_all = holds_all && (size_t) groups[g].n_slots == layers_in_group[g] * n_expert;
    }
    // streamed prefill: two layers of experts per group besides the pool, else prefill stays upstream's
    if (params.stream_prefill < SPAC_STREAM_OFF || params.stream_prefill > SPAC_STREAM_USED) {
        throw std::runtime_error("stream_prefill must be SPAC_STREAM_OFF, _AHEAD or _USED, got " + std::to_string(params.stream_prefill));
    }
    stream_prefill = params.stream_prefill;
    upload_on_miss = std::max(0, params.upload_on_miss_tokens);
    if ((stream_prefill != SPAC_STREAM_OFF || upload_on_miss > 0) && !holds_all) {
        size_t staging_bytes = 0;
        for (const auto & g : groups) {
            staging_bytes += 2 * (size_t) n_expert * g.slot_bytes;
        }
        if (mem_free > 0 && pool_bytes + staging_bytes > mem_free) {
            LLAMA_LOG_WARN("%s: streamed prefill and upload on miss off: their %.1f MiB of staging slots do not fit beside the pool on %s\n",
                           __func__, staging_bytes / 1048576.0, ggml_backend_dev_name(dev));
            stream_prefill = SPAC_STREAM_OFF;
            upload_on_miss = 0;
        } else {
            pool_bytes += staging_bytes;
        }
    }

    has_staging = (stream_prefill != SPAC_STREAM_OFF || upload_on_miss > 0) && !holds_all;
    miss_gate_max = std::max(0, params.miss_gate_tokens);

    // pool tensors: one per kind per group, each expert at [.., slot]; the last slot stays zero
    ggml_init_params ip = { (groups.size() * LLAMA_EXPERT_N_KINDS + 1) * ggml_tensor_overhead(), nullptr, true };
    ctx = ggml_init(ip);
    for (size_t g = 0; g < groups.size(); ++g) {
        const int m0 = (int) (std::find(layer_group.begin(), layer_group.end(), (int) g) - layer_group.begin());
        for (int k = 0; k < LLAMA_EXPERT_N_KINDS; ++k) {
            const ggml_tensor * t = host[m0][k];
            if (!t) {
                continue;
            }
            int64_t ne[GGML_MAX_DIMS] = { t->ne[0], t->ne[1], t->ne[2], t->ne[3] };
            ne[expert_dim(t)] = groups[g].n_slots + n_map_positions + (has_staging ? 2 * n_expert : 0);
            groups[g].pool[k] = ggml_new_tensor(ctx, t->type, ggml_n_dims(t), ne);
            ggml_format_name(groups[g].pool[k], "expert_pool.%zu.%d", g, k);
        }
        // a CPU pool skips non-resident rows (id -1) instead of multiplying the zero slot
        groups[g].absent = skips_absent ? -1 : groups[g].n_slots;
        groups[g].staging = groups[g].n_slots + n_map_positions;
        groups[g].owner.assign(groups[g].n_slots, -1);
        for (int32_t s = groups[g].n_slots - 1; s >= 0; --s) {
            groups[g].free_slots.push_back(s);
        }
        groups[g].frozen.assign(groups[g].n_slots, 0);
        groups[g].last_use.assign(groups[g].n_slots, 0);
    }
    ggml_backend_buffer_type_t buft = ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU
        ? ggml_backend_cpu_buffer_type()  // plain layout: never the CPU_REPACK type
        : ggml_backend_dev_buffer_type(dev);
    buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
    if (buf == nullptr) {
        ggml_free(ctx);
        throw std::runtime_error("could not allocate the expert pool on " + std::string(ggml_backend_dev_name(dev)));
    }
    ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    ggml_backend_buffer_clear(buf, 0);

    // experts are copied from the file layout: host tensors may have been repacked for the CPU
    gguf_init_params gp = { true, nullptr };
    gguf_context * gguf = gguf_init_from_file(params.model_path, gp);
    if (gguf == nullptr) {
        ggml_backend_buffer_free(buf);
        ggml_free(ctx);
        throw std::runtime_error(std::string("cannot read GGUF ") + params.model_path);
    }
    std::string bad;
    for (const auto & kinds : host) {
        file_offs.emplace_back();
        for (int k = 0; k < LLAMA_EXPERT_N_KINDS; ++k) {
            if (!kinds[k]) {
                continue;
            }
            const int64_t id = gguf_find_tensor(gguf, kinds[k]->name);
            if (id < 0 || gguf_get_tensor_type(gguf, id) != kinds[k]->type || gguf_get_tensor_size(gguf, id) != ggml_nbytes(kinds[k])) {
                bad = kinds[k]->name;
                break;
            }
            file_offs.back()[k] = gguf_get_data_offset(gguf) + gguf_get_tensor_offset(gguf, id);
        }
    }
    // same names and shapes are not enough (two random models share them): a tensor must also
    // hold the same bytes in the file and in memory. The first MoE router, unless the CPU
    // repacked it (extra buffer types cannot be read back), then the token embeddings.
    auto readable = [](const ggml_tensor * t) {
        if (t == nullptr || t->buffer == nullptr) {
            return false;
        }
        ggml_backend_buffer_type_t bt = ggml_backend_buffer_get_type(t->buffer);
        ggml_backend_dev_t d = ggml_backend_buft_get_device(bt);
        return ggml_backend_buft_is_host(bt) || (d != nullptr && ggml_backend_dev_type(d) != GGML_BACKEND_DEVICE_TYPE_CPU);
    };
    const ggml_tensor * probe = model.layers[layer_il[0]].ffn_gate_inp;
    if (!readable(probe)) {
        probe = model.tok_embd;
    }
    const size_t probe_bytes = std::min<size_t>(ggml_nbytes(probe), 1 << 20);
    size_t probe_off = 0;
    if (bad.empty()) {
        const int64_t id = gguf_find_tensor(gguf, probe->name);
        if (id < 0 || gguf_get_tensor_size(gguf, id) != ggml_nbytes(probe)) {
            bad = probe->name;
        } else {
            probe_off = gguf_get_data_offset(gguf) + gguf_get_tensor_offset(gguf, id);
        }
    }
    gguf_free(gguf);
    if (bad.empty()) {
        file    = std::make_unique<llama_file>(params.model_path, "rb");
        mapping = std::make_unique<llama_mmap>(file.get(), 0, false);
        if (readable(probe)) {
            std::vector<uint8_t> in_memory(probe_bytes);
            ggml_backend_tensor_get(probe, in_memory.data(), 0, in_memory.size());
            if (memcmp(in_memory.data(), (const uint8_t *) mapping->addr() + probe_off, in_memory.size()) != 0) {
                bad = probe->name;
            }
        } else {
            LLAMA_LOG_WARN("%s: cannot read %s back to check that %s is the loaded model\n", __func__, probe->name, params.model_path);
        }
    }
    if (!bad.empty()) {
        ggml_backend_buffer_free(buf);
        ggml_free(ctx);
        throw std::runtime_error(std::string(params.model_path) + " does not match the loaded model (tensor " + bad + ")");
    }
    // copies read the file mapping, unless the model holds the tensor in the pool device's pinned
    // host buffer (llama.cpp's --no-mmap with a GPU): the same bytes (checked above), which a GPU
    // copies from without staging them through pageable memory (H100: 55 against 6.3 GB/s)
    ggml_backend_buffer_type_t pinned = ggml_backend_dev_host_buffer_type(dev);
    int32_t n_pinned = 0;
    for (size_t m = 0; m < host.size(); ++m) {
        copy_src.emplace_back();
        for (int k = 0; k < LLAMA_EXPERT_N_KINDS; ++k) {
            const ggml_tensor * t = host[m][k];
            const bool in_pinned = pinned != nullptr && t != nullptr && t->buffer != nullptr &&
                                   ggml_backend_buffer_get_type(t->buffer) == pinned;
            copy_src.back()[k] = in_pinned ? (const uint8_t *) t->data : (const uint8_t *) mapping->addr() + file_offs[m][k];
            n_pinned += in_pinned;
        }
    }
    if (n_pinned > 0) {
        LLAMA_LOG_INFO("%s: %d expert tensors copied from %s (pinned host memory)\n", __func__, n_pinned,
                       ggml_backend_buft_name(pinned));
    } else if (params.pin_mapping && backend != nullptr) {
        pin_mapping();
    }
    const size_t n_keys = layer_il.size() * n_expert;
    slot_of.assign(n_keys, -1);
    use_count.assign(n_keys, 0.0f);
    use_class.assign(n_keys, 0);
    use_last.assign(n_keys, 0.0);
    utility.assign(n_keys, 0);
    threshold.assign(layer_il.size(), INT32_MAX); // no plan yet: nothing is wanted
    evict_rank.assign(n_keys, INT32_MAX);
    pending.utility.assign(n_keys, 0);
    pending.threshold.assign(layer_il.size(), INT32_MAX);
    int32_t n_slots = 0;
    for (const auto & g : groups) {
        n_slots += g.n_slots;
    }
    stats.n_slots = n_slots;
    for (int32_t m = 0; m < n_moe_layers(); ++m) {
        gate_args.push_back({ this, m });
    }
    if (holds_all) {
        fill_every_slot();
    }
    if (stream_prefill == SPAC_STREAM_AHEAD && backend != nullptr) {
        // an asynchronous device: a staging buffer is refilled only after the device has read it
        for (auto & ev : stage_events) {
            ev = ggml_backend_event_new(dev);
        }
        if (stage_events[0] == nullptr || stage_events[1] == nullptr) {
            LLAMA_LOG_WARN("%s: streamed prefill off: %s has no events to order the staging copies\n",
                           __func__, ggml_backend_dev_name(dev));
            stream_prefill = SPAC_STREAM_OFF;
        }
    }

    LLAMA_LOG_INFO("%s: MoE layers %d..%d of %d x %d experts, %zu slot group(s), %d slots, %.1f MiB on %s\n", __func__,
                   first_moe, end_moe - 1, n_moe_layers(), n_expert, groups.size(), n_slots, pool_bytes / 1048576.0,
                   ggml_backend_dev_name(dev));

    worker = std::thread([this] { worker_loop(); });
}

llama_expert_pool::~llama_expert_pool() {
    while (!drafts.empty()) {
        detach_draft(drafts.back());
    }
    {
        std::lock_guard<std::mutex> lk(mtx);
        stop = true;
    }
    cv_work.notify_all();
    if (worker.joinable()) {
        worker.join();
    }
    for (auto ev : stage_events) {
        if (ev != nullptr) {
            ggml_backend_event_free(ev);
        }
    }
    if (copy_backend != nullptr) {
        ggml_backend_free(copy_backend);
    }
    if (pinned_mapping != nullptr) {
        auto unregister = (void (*)(void *)) ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(dev),
                                                                               "ggml_backend_unregister_host_buffer");
        if (unregister != nullptr) {
            unregister(pinned_mapping);
        }
    }
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
}

int llama_expert_pools::find(int il) const {
    for (size_t i = 0; i < pools.size(); ++i) {
        const int m = pools[i]->moe_index(il);
        if (m >= 0 && pools[i]->owns(m)) {
            return (int) i;
        }
    }
    return -1;
}

ggml_tensor * llama_expert_pool::pool_tensor(int il, const ggml_tensor * t) const {
    const int m = moe_index(il);
    if (m < 0 || !owns(m) || t == nullptr) {
        return nullptr;
    }
    for (int k = 0; k < LLAMA_EXPERT_N_KINDS; ++k) {
        if (host[m][k] == t) {
            return groups[layer_group[m]].pool[k];
        }
    }
    return nullptr;
}

void llama_expert_pool::fill_maps(int32_t * cpu, int32_t * dev_map, uint32_t n_tokens, bool draft) {
    std::unique_lock<std::mutex> lk(mtx);
    if (!draft && gates_misses(n_tokens)) {
        // the gates' uploads go through the stage queue, layer by layer; the ClassLRU's clock
        // advances by the ubatch's tokens
        begin_stages(lk);
        token_clock += n_tokens;
    }
    const int32_t P = n_map_positions;
    last_dev_map.resize(slot_of.size());
    for (int m = first_moe; m < end_moe; ++m) {
        group & g = groups[layer_group[m]];
        for (int e = 0; e < n_expert; ++e) {
            const int32_t key  = m * n_expert + e;
            const int32_t slot = slot_of[key];
            cpu[key] = slot >= 0 ? -1 : e;
            for (int32_t p = 0; p < P; ++p) {
                dev_map[((size_t) m * P + p) * n_expert + e] = slot >= 0 ? slot : g.absent < 0 ? -1 : g.absent + p;
            }
            if (draft) {
                if (slot >= 0) {
                    g.frozen[slot] |= FROZEN_DRAFT;
                }
                continue;
            }
            last_dev_map[key] = slot >= 0 ? slot : g.absent;
            if (slot >= 0) {
                g.frozen[slot] |= FROZEN_TARGET;
            } else if (utility[key] >= threshold[m]) { // wanted, still not resident
                stats.n_prefetch_late++;
            }
        }
    }
    if (!draft) {
        last_split_pending = true;
    }
}

void llama_expert_pool::on_synchronized(const int32_t * routing_ids, int32_t n_tokens) {
    if (!last_split_pending && routing_ids == nullptr) {
        return; // nothing ran since the last synchronize: no slot is frozen, nothing to count
    }
    {
        std::lock_guard<std::mutex> lk(mtx);
        for (auto & g : groups) {
            for (auto & f : g.frozen) {
                f &= (uint8_t) ~FROZEN_TARGET;
            }
        }
        if (routing_ids != nullptr) {
            const size_t n = (size_t) n_tokens * n_expert_used;
            for (int m = first_moe; m < end_moe; ++m) {
                const int32_t absent = groups[layer_group[m]].absent;
                const int32_t * ids = routing_ids + (size_t) m * n;
                uint64_t on_dev = 0;
                if (last_split_pending) {
                    for (size_t i = 0; i < n; ++i) {
                        on_dev += last_dev_map[(size_t) m * n_expert + ids[i]] != absent;
                    }
                }
                stats.n_expert_tokens_device += on_dev;
                stats.n_expert_tokens_cpu    += n - on_dev;
            }
        }
        last_split_pending = false;
        retry_refused();
    }
    cv_work.notify_all(); // unfrozen slots may be evictable now
}

void llama_expert_pool::unfreeze(uint8_t bit) {
    {
        std::lock_guard<std::mutex> lk(mtx);
        for (auto & g : groups) {
            for (auto & f : g.frozen) {
                f &= (uint8_t) ~bit;
            }
        }
        retry_refused();
    }
    cv_work.notify_all();
}

void llama_expert_pool::on_draft_synchronized() {
    unfreeze(FROZEN_DRAFT);
}

void llama_expert_pool::begin_stages(std::unique_lock<std::mutex> & lk) {
    // requests an interrupted ubatch left are dropped; a copy in flight lands first
    stage_queue.clear();
    cv_stage.wait(lk, [&] { return !staging; });
    stage_keys.assign(n_moe_layers(), {});
    stage_slots.assign(n_moe_layers(), {});
    stage_done = first_moe;
}

void llama_expert_pool::fill_stage_maps(int32_t * map, uint32_t n_tokens) {
    std::unique_lock<std::mutex> lk(mtx);
    begin_stages(lk);
    caching = caches(n_tokens);
    last_dev_map.resize(slot_of.size());
    for (int32_t m = first_moe; m < end_moe; ++m) {
        group & g = groups[layer_group[m]];
        for (int32_t e = 0; e < n_expert; ++e) {
            const int32_t key  = m * n_expert + e;
            const int32_t slot = slot_of[key];
            if (slot >= 0) {
                if (!caching) { // a cached ubatch's gates freeze what their layers map
                    g.frozen[slot] |= FROZEN_TARGET;
                }
                map[key] = slot;
            } else {
                map[key] = staging_slot(g, m, e);
                stage_keys[m].push_back(e);
                stage_slots[m].push_back(map[key]);
            }
            last_dev_map[key] = map[key]; // every expert computes on the device
        }
    }
    last_split_pending = true;
    // the first two layers take the two buffers, after whatever the device still has to do
    // (SPAC_STREAM_USED: each layer's gate asks once its router has run)
    for (int32_t m = first_moe; m < (stages_used_only(n_tokens) ? first_moe : std::min<int32_t>(first_moe + 2, end_moe)); ++m) {
        ggml_backend_event_t ev = stage_events[m % 2];
        if (ev != nullptr) {
            ggml_backend_event_record(ev, backend);
        }
        stage_queue.push_back({ m, ev });
    }
    lk.unlock();
    cv_work.notify_all();
}

void llama_expert_pool::stage_gate(int32_t m, const int32_t * sel, int64_t n, int32_t * map_out) {
    const int64_t t0 = ggml_time_us();
    std::unique_lock<std::mutex> lk(mtx);
    group & g = groups[layer_group[m]];
    if (sel != nullptr) {
        // the router has run (its ids reached the host, so the device is done with layer m-2's
        // buffer): only the non-resident experts some token chose are copied
        std::vector<uint8_t> chosen(n_expert, 0);
        for (int64_t i = 0; i < n; ++i) {
            if (sel[i] >= 0 && sel[i] < n_expert) {
                chosen[sel[i]] = 1;
            }
        }
        auto & keys  = stage_keys[m];
        auto & slots = stage_slots[m];
        if (caching) {
            // llama.cpp's cache: the hits are touched first, then the misses (ascending ids) take
            // the least recently used slots; residency as it is now (an earlier layer of this
            // ubatch may have evicted one of this layer's experts)
            keys.clear();
            slots.clear();
            for (int32_t e = 0; e < n_expert; ++e) {
                const int32_t s = slot_of[m * n_expert + e];
                if (chosen[e] && s >= 0) {
                    g.frozen[s] |= FROZEN_TARGET;
                    g.last_use[s] = ++use_clock;
                }
            }
            for (int32_t e = 0; e < n_expert; ++e) {
                if (!chosen[e] || slot_of[m * n_expert + e] >= 0) {
                    continue;
                }
                int32_t s = lru_slot(g, m, chosen);
                if (s < 0) { // every slot is mapped by this layer: the staging slot, uncached
                    s = staging_slot(g, m, e);
                } else {
                    g.owner[s] = -2; // being copied: in no map, never a victim
                    g.frozen[s] |= FROZEN_TARGET;
                    g.last_use[s] = ++use_clock;
                }
                keys.push_back(e);
                slots.push_back(s);
            }
        } else {
            size_t j = 0;
            for (size_t i = 0; i < keys.size(); ++i) {
                if (chosen[keys[i]]) {
                    keys[j] = keys[i];
                    slots[j++] = slots[i];
                }
            }
            keys.resize(j);
            slots.resize(j);
        }
        stage_queue.push_back({ m, nullptr });
        cv_work.notify_all();
    } else if (m >= first_moe + 1 && m + 1 < end_moe) {
        // everything queued on the device so far includes layer m-1's experts, the last reader
        // of the buffer that layer m+1 takes
        ggml_backend_event_t ev = stage_events[(m + 1) % 2];
        if (ev != nullptr) {
            ggml_backend_event_record(ev, backend);
        }
        stage_queue.push_back({ m + 1, ev });
        cv_work.notify_all();
    }
    cv_stage.wait(lk, [&] { return stage_done > m; });
    if (caching) {
        // the uploaded experts are cached now; the layer's map: its slots, else the staging slots
        for (size_t i = 0; i < stage_keys[m].size(); ++i) {
            const int32_t s = stage_slots[m][i];
            if (s < g.n_slots) {
                const int32_t key = m * n_expert + stage_keys[m][i];
                g.owner[s]   = key;
                slot_of[key] = s;
            }
        }
        if (map_out != nullptr) {
            for (int32_t e = 0; e < n_expert; ++e) {
                const int32_t s = slot_of[m * n_expert + e];
                map_out[e] = s >= 0 ? s : staging_slot(g, m, e);
                last_dev_map[m * n_expert + e] = map_out[e];
            }
        }
    }
    stats.stage_wait_us += (double) (ggml_time_us() - t0);
}

int32_t llama_expert_pool::lru_slot(group & g, int32_t m, const std::vector<uint8_t> & chosen) {
    if (const int32_t s = take_free_slot(g); s >= 0) {
        return s;
    }
    // as llama.cpp's cache: any slot but this layer's chosen experts, including those an earlier
    // layer of this ubatch used (the device is done with them: this layer's router has run)
    int32_t best = -1;
    for (int32_t s = 0; s < g.n_slots; ++s) {
        const int32_t key = g.owner[s];
        const bool this_layer = key >= 0 && key / n_expert == m && chosen[key % n_expert];
        if (key >= 0 && !this_layer && !(g.frozen[s] & ~FROZEN_TARGET) && (best < 0 || g.last_use[s] < g.last_use[best])) {
            best = s;
        }
    }
    if (best >= 0) {
        evict(g, best);
    }
    return best;
}

void llama_expert_pool::count_uses(int32_t m, const std::vector<int32_t> & count) {
    const double now = gate_now(m);
    for (int32_t e = 0; e < n_expert; ++e) {
        if (count[e] == 0) {
            continue;
        }
        const int32_t key = m * n_expert + e;
        const double age = now - use_last[key];
        use_count[key] = (float) (use_count[key] * std::exp2(-age / 128.0) + count[e]);
        use_class[key] = (int8_t) std::min(7.0, std::floor(std::log2((double) use_count[key])));
        use_last[key]  = now;
    }
}

int32_t llama_expert_pool::class_lru_slot(group & g, int32_t m, const std::vector<int32_t> & count) {
    if (const int32_t s = take_free_slot(g); s >= 0) {
        return s;
    }
    // llama.cpp master's victim: the largest age / 2^class, never one of this layer's chosen experts;
    // an earlier layer's are allowed (this layer's router has run: the device is done with them), a
    // pool draft's and a slot being copied are not. Never used: first.
    const double now = gate_now(m);
    int32_t best = -1;
    double best_key = -1.0;
    for (int32_t s = 0; s < g.n_slots; ++s) {
        const int32_t key = g.owner[s];
        if (key < 0 || (key / n_expert == m && count[key % n_expert] > 0) || (g.frozen[s] & ~FROZEN_TARGET)) {
            continue;
        }
        const double k = use_count[key] > 0.0f ? (now - use_last[key]) / std::exp2((double) use_class[key]) : INFINITY;
        if (best < 0 || k > best_key) {
            best = s;
            best_key = k;
        }
    }
    if (best >= 0) {
        evict(g, best);
    }
    return best;
}

bool llama_expert_pool::set_miss_costs(const spac_miss_costs * costs, std::string & err) {
    if (costs != nullptr) {
        std::vector<float> all = { costs->upload_us, costs->sync_us, costs->horizon_tokens };
        all.insert(all.end(), costs->host_us, costs->host_us + SPAC_MISS_MAX_TOKENS);
        all.insert(all.end(), costs->device_us, costs->device_us + SPAC_MISS_MAX_TOKENS);
        for (float v : all) {
            if (!std::isfinite(v) || v < 0.0f) {
                err = "every miss cost must be finite and >= 0, got " + std::to_string(v);
                return false;
            }
        }
    }
    std::lock_guard<std::mutex> lk(mtx);
    miss_costs_set = costs != nullptr;
    miss_costs = costs ? *costs : spac_miss_costs {};
    return true;
}

void llama_expert_pool::miss_gate(int32_t m, const int32_t * sel, int64_t n, int32_t * out) {
    const int64_t t0 = ggml_time_us();
    std::unique_lock<std::mutex> lk(mtx);
    group & g = groups[layer_group[m]];
    std::vector<int32_t> count(n_expert, 0);
    for (int64_t i = 0; i < n; ++i) {
        if (sel[i] >= 0 && sel[i] < n_expert) {
            count[sel[i]]++;
        }
    }
    count_uses(m, count);
    const spac_miss_costs & c = miss_costs;
    auto at = [&](const float * t, int32_t tokens) { return t[std::min(tokens, SPAC_MISS_MAX_TOKENS) - 1]; };

    // HybriMoE's two-ended greedy with an upload credited for its reuse (the simulator's
    // ReuseCredited): the hottest miss goes to the device while its upload and compute end no later
    // than the host would end the coldest, plus the credit; else the coldest goes to the host
    float device_free = c.sync_us;
    std::vector<int32_t> misses;
    for (int32_t e = 0; e < n_expert; ++e) {
        if (count[e] == 0) {
            continue;
        }
        const int32_t s = slot_of[m * n_expert + e];
        if (s >= 0) {
            g.last_use[s] = ++use_clock;
            device_free += at(c.device_us, count[e]);
        } else {
            misses.push_back(e);
        }
    }
    const float saturation = (float) (1.0 / (1.0 - std::exp2(-1.0 / 128.0)));
    std::vector<float> credit(n_expert, 0.0f);
    for (int32_t e : misses) {
        credit[e] = use_count[m * n_expert + e] / saturation * c.horizon_tokens *
                    std::max(c.host_us[0] - c.device_us[0], 0.0f);
    }
    const float per_token = std::max(c.host_us[0], 1e-6f);
    std::stable_sort(misses.begin(), misses.end(), [&](int32_t a, int32_t b) {
        return count[a] + credit[a] / per_token > count[b] + credit[b] / per_token;
    });
    std::vector<uint8_t> to_device(n_expert, 0);
    if (miss_costs_set) {
        float host_free = 0.0f, link_free = 0.0f;
        size_t lo = 0, hi = misses.size();
        while (lo < hi) {
            const int32_t hot = misses[lo], cold = misses[hi - 1];
            const float arrival = link_free + c.upload_us;
            const float device_done = std::max(device_free, arrival) + at(c.device_us, count[hot]);
            const float host_done = host_free + at(c.host_us, count[cold]);
            if (device_done <= host_done + credit[hot]) {
                to_device[hot] = 1;
                link_free = arrival;
                device_free = device_done;
                lo++;
            } else {
                host_free = host_done;
                hi--;
            }
        }
    }

    // the device's misses: into a slot, else (every slot is this layer's, a draft's or being
    // copied) once through the staging slot where there is one, else the host after all
    auto & keys  = stage_keys[m];
    auto & slots = stage_slots[m];
    keys.clear();
    slots.clear();
    for (int32_t e = 0; e < n_expert; ++e) {
        if (!to_device[e]) {
            stats.n_gate_host += count[e] > 0 && slot_of[m * n_expert + e] < 0;
            continue;
        }
        int32_t s = class_lru_slot(g, m, count);
        if (s >= 0) {
            g.owner[s] = -2; // being copied: in no map, never a victim
            g.frozen[s] |= FROZEN_TARGET;
            g.last_use[s] = ++use_clock;
            stats.n_gate_uploads++;
        } else if (has_staging) {
            s = staging_slot(g, m, e);
            stats.n_gate_streamed++;
        } else {
            to_device[e] = 0;
            stats.n_gate_host++;
            continue;
        }
        keys.push_back(e);
        slots.push_back(s);
    }
    if (!keys.empty()) {
        stage_queue.push_back({ m, nullptr });
        cv_work.notify_all();
        cv_stage.wait(lk, [&] { return stage_done > m; });
        for (size_t i = 0; i < keys.size(); ++i) {
            if (slots[i] < g.n_slots) {
                const int32_t key = m * n_expert + keys[i];
                g.owner[slots[i]] = key;
                slot_of[key] = slots[i];
            }
        }
    }

    const int32_t P = n_map_positions;
    for (int32_t e = 0; e < n_expert; ++e) {
        const int32_t key = m * n_expert + e;
        const int32_t s = slot_of[key] >= 0 ? slot_of[key] : to_device[e] ? staging_slot(g, m, e) : -1;
        out[e] = s >= 0 ? -1 : e;
        for (int32_t p = 0; p < P; ++p) {
            out[(size_t) (1 + p) * n_expert + e] = s >= 0 ? s : g.absent < 0 ? -1 : g.absent + p;
        }
        last_dev_map[key] = s >= 0 ? s : g.absent;
    }
    stats.stage_wait_us += (double) (ggml_time_us() - t0);
}

void llama_expert_pool::attach_draft(llama_context * draft) {
    if (draft == &lctx) {
        throw std::runtime_error("the draft context must be a second context, not the engine's own");
    }
    if (&draft->get_model() != &lctx.get_model()) {
        throw std::runtime_error("a pool draft context must be on the engine's model (contexts share its weights)");
    }
    if (!draft->get_expert_pools().empty()) {
        throw std::runtime_error("the draft context has an expert engine of its own");
    }
    if (std::find(drafts.begin(), drafts.end(), draft) != drafts.end()) {
        throw std::runtime_error("the draft context already drafts through this pool");
    }
    ggml_backend_t draft_backend = nullptr; // nullptr: the CPU's, as for the engine's context
    if (backend != nullptr) {
        draft_backend = draft->backend_of(ggml_backend_get_device(backend));
        if (draft_backend == nullptr) {
            throw std::runtime_error("the draft context does not use the pool's device");
        }
    }
    draft->add_draft_pool(this, draft_backend); // throws when another context's pools are attached
    drafts.push_back(draft);
}

void llama_expert_pool::detach_draft(llama_context * draft) {
    auto it = std::find(drafts.begin(), drafts.end(), draft);
    if (it == drafts.end()) {
        return;
    }
    drafts.erase(it);
    draft->remove_draft_pool(this); // synchronizes: its ubatches are done
    unfreeze(FROZEN_DRAFT);
}

int32_t llama_expert_pool::set_plan(const uint8_t * util, const int32_t * tau,
                                    const int32_t * prefetch, int32_t n_prefetch,
                                    const int32_t * evict, int32_t n_evict, std::string & err) {
    const int32_t n_moe = n_moe_layers();
    if (util == nullptr || tau == nullptr) {
        err = "utility and threshold are required";
        return -1;
    }
    for (int32_t m = 0; m < n_moe; ++m) {
        if (tau[m] < 1) {
            err = "threshold[" + std::to_string(m) + "] = " + std::to_string(tau[m]) + " must be >= 1";
            return -1;
        }
    }
    auto check_pairs = [&](const int32_t * pairs, int32_t n, const char * what) {
        if (n > 0 && pairs == nullptr) {
            err = std::string(what) + " is NULL with n > 0";
            return false;
        }
        for (int32_t i = 0; i < n; ++i) {
            if (pairs[2*i] < 0 || pairs[2*i] >= n_moe) {
                err = std::string(what) + "[" + std::to_string(i) + "]: MoE layer " + std::to_string(pairs[2*i]) +
                      " out of range [0, " + std::to_string(n_moe) + ")";
                return false;
            }
            if (pairs[2*i + 1] < 0 || pairs[2*i + 1] >= n_expert) {
                err = std::string(what) + "[" + std::to_string(i) + "]: expert " + std::to_string(pairs[2*i + 1]) +
                      " out of range [0, " + std::to_string(n_expert) + ")";
                return false;
            }
        }
        return true;
    };
    if (n_prefetch < 0 || n_evict < 0 || !check_pairs(prefetch, n_prefetch, "prefetch") || !check_pairs(evict, n_evict, "evict")) {
        if (err.empty()) {
            err = "negative list length";
        }
        return -1;
    }

    {
        std::lock_guard<std::mutex> lk(mtx);
        std::memcpy(pending.utility.data(), util, pending.utility.size());
        std::memcpy(pending.threshold.data(), tau, pending.threshold.size() * sizeof(int32_t));
        pending.evict.clear();
        for (int32_t i = 0; i < n_evict; ++i) {
            if (owns(evict[2*i])) {
                pending.evict.push_back(evict[2*i] * n_expert + evict[2*i + 1]);
            }
        }
        pending.prefetch.clear();
        for (int32_t i = 0; i < n_prefetch; ++i) {
            if (owns(prefetch[2*i])) { // another device's layer: its own pool takes it
                pending.prefetch.push_back(prefetch[2*i] * n_expert + prefetch[2*i + 1]);
            }
        }
        pending.has_prefetch = prefetch != nullptr;
        plan_seq++;
    }
    cv_work.notify_one();
    return 0;
}

void llama_expert_pool::apply_plan(std::unique_lock<std::mutex> & lk) {
    const uint64_t seq = plan_seq;
    std::swap(utility, pending.utility);
    std::swap(threshold, pending.threshold);
    for (int32_t key : evict_keys) {
        evict_rank[key] = INT32_MAX;
    }
    evict_keys.swap(pending.evict);
    for (size_t i = 0; i < evict_keys.size(); ++i) {
        evict_rank[evict_keys[i]] = (int32_t) i;
    }
    queue_by_utility = !pending.has_prefetch;
    next_queue.clear();
    if (!queue_by_utility) {
        next_queue.swap(pending.prefetch);
    } else {
        // multi-level queue: highest utility first, layer order (then expert) within a level;
        // a counting sort over the levels, two passes over the experts. Built without the lock:
        // only this thread writes utility, threshold and slot_of, and the old queue is dropped.
        lk.unlock();
        size_t count[257] = {0};
        for (int32_t m = first_moe; m < end_moe; ++m) {
            const int32_t tau = threshold[m];
            const uint8_t * u = utility.data() + (size_t) m * n_expert;
            const int32_t * s = slot_of.data() + (size_t) m * n_expert;
            for (int32_t e = 0; e < n_expert; ++e) {
                count[256 - u[e]] += s[e] < 0 && u[e] >= tau;
            }
        }
        for (int i = 1; i < 257; ++i) {
            count[i] += count[i - 1];
        }
        next_queue.resize(count[256]);
        for (int32_t m = first_moe; m < end_moe; ++m) {
            const int32_t tau = threshold[m];
            const uint8_t * u = utility.data() + (size_t) m * n_expert;
            const int32_t * s = slot_of.data() + (size_t) m * n_expert;
            for (int32_t e = 0; e < n_expert; ++e) {
                if (s[e] < 0 && u[e] >= tau) {
                    next_queue[count[255 - u[e]]++] = m * n_expert + e;
                }
            }
        }
        lk.lock();
    }
    queue.swap(next_queue);
    queue_pos = 0;
    for (auto & g : groups) {
        g.no_room_below = -1;
    }
    retry_when_thawed = false;
    plan_applied = seq;
}

void llama_expert_pool::retry_refused() {
    // a plan is sent once when it does not change (a static placement): copies that found every
    // slot frozen by a running graph must not wait for a next plan that may never come. The
    // queue is walked again; what is resident by now is skipped.
    if (retry_when_thawed) {
        retry_when_thawed = false;
        queue_pos = 0;
    }
}

void llama_expert_pool::evict(group & g, int32_t slot) {
    slot_of[g.owner[slot]] = -1;
    g.owner[slot] = -1;
    stats.n_evictions++;
}

int32_t llama_expert_pool::take_free_slot(group & g) {
    if (g.free_slots.empty()) {
        return -1;
    }
    const int32_t s = g.free_slots.back();
    g.free_slots.pop_back();
    return s;
}

int32_t llama_expert_pool::pick_slot(group & g, int32_t key) {
    if (const int32_t s = take_free_slot(g); s >= 0) {
        return s;
    }
    // the queue is ordered by utility: once a request found no room, lower ones will not either
    if (no_evict || (queue_by_utility && (int32_t) utility[key] <= g.no_room_below)) {
        return -1;
    }
    // eviction order: the plan's explicit list, then experts the plan no longer wants, then
    // the lowest utility, then layer and expert (not the slot: the order must not depend on
    // where earlier copies landed); frozen slots and slots being copied are never touched
    int32_t best = -1;
    std::tuple<int32_t, int, int, int32_t> best_rank;
    for (int32_t s = 0; s < g.n_slots; ++s) {
        const int32_t o = g.owner[s];
        if (o < 0 || g.frozen[s]) {
            continue;
        }
        const auto rank = std::make_tuple(evict_rank[o], (int) wanted(o), (int) utility[o], o);
        if (best < 0 || rank < best_rank) {
            best = s;
            best_rank = rank;
        }
    }
    if (best < 0) {
        retry_when_thawed = true; // every resident slot is frozen: walk the queue again when they thaw
        return -1;
    }
    const int32_t victim = g.owner[best];
    if (evict_rank[victim] == INT32_MAX && wanted(victim) && utility[victim] >= utility[key]) {
        if (queue_by_utility) {
            g.no_room_below = utility[key]; // everything resident is at least as useful
        }
        return -1;
    }
    evict(g, best);
    return best;
}

void llama_expert_pool::worker_loop() {
    std::unique_lock<std::mutex> lk(mtx);
    while (true) {
        if (idle()) {
            cv_idle.notify_all();
        }
        cv_work.wait(lk, [&] { return stop || !stage_queue.empty() || plan_applied != plan_seq || queue_pos < queue.size(); });
        if (stop) {
            return;
        }
        if (!stage_queue.empty()) { // a streamed prefill waits for these: before any plan copy
            const stage_request req = stage_queue.front();
            stage_queue.pop_front();
            staging = true;
            lk.unlock();
            if (req.event != nullptr) {
                ggml_backend_event_synchronize(req.event);
            }
            const int64_t t0 = ggml_time_us();
            uint64_t n_calls = 0;
            const size_t bytes = copy_runs(req.m, stage_keys[req.m], stage_slots[req.m], n_calls);
            finish_copies();
            const int64_t t1 = ggml_time_us();
            lk.lock();
            staging = false;
            stage_done = req.m + 1;
            stats.n_staged += stage_keys[req.m].size();
            stats.n_stage_batches++;
            stats.bytes_staged += bytes;
            stats.stage_copy_us += (double) (t1 - t0);
            stats.n_copy_calls += n_calls;
            cv_stage.notify_all();
            continue;
        }
        if (plan_applied != plan_seq) {
            apply_plan(lk);
            continue;
        }
        const int32_t key = queue[queue_pos++];
        if (slot_of[key] >= 0) {
            continue;
        }
        const int m = key / n_expert;
        group & g = groups[layer_group[m]];
        const int32_t slot = pick_slot(g, key);
        if (slot < 0) {
            // the rest of the queue has no higher utility: stop early when no group has room
            bool room = !queue_by_utility;
            for (const auto & other : groups) {
                room = room || !other.free_slots.empty() || (!no_evict && other.no_room_below < (int32_t) utility[key]);
            }
            if (!room) {
                queue_pos = queue.size();
            }
            continue;
        }
        g.owner[slot] = -2; // being copied: in no map, never a victim
        // the batch: the queue's next experts while they are of this layer and get a slot
        std::vector<int32_t> batch_keys  = { key };
        std::vector<int32_t> batch_slots = { slot };
        while ((int32_t) batch_keys.size() < copy_batch && queue_pos < queue.size() && queue[queue_pos] / n_expert == m) {
            const int32_t next = queue[queue_pos];
            if (slot_of[next] < 0) {
                const int32_t s = pick_slot(g, next);
                if (s < 0) {
                    break; // left in the queue: the loop above decides whether anything has room
                }
                g.owner[s] = -2;
                batch_keys.push_back(next);
                batch_slots.push_back(s);
            }
            queue_pos++;
        }
        copying = true;
        lk.unlock();

        const int64_t t0 = ggml_time_us();
        std::vector<std::pair<int32_t, int32_t>> by_expert; // (expert, slot), ascending experts
        for (size_t i = 0; i < batch_keys.size(); ++i) {
            by_expert.push_back({ batch_keys[i] % n_expert, batch_slots[i] });
        }
        std::sort(by_expert.begin(), by_expert.end());
        std::vector<int32_t> experts, slots;
        for (const auto & [e, s] : by_expert) {
            experts.push_back(e);
            slots.push_back(s);
        }
        uint64_t n_calls = 0;
        const size_t bytes = copy_runs(m, experts, slots, n_calls);
        finish_copies();
        const int64_t t1 = ggml_time_us();

        lk.lock();
        for (size_t i = 0; i < batch_keys.size(); ++i) {
            g.owner[batch_slots[i]] = batch_keys[i];
            slot_of[batch_keys[i]]  = batch_slots[i]; // published: the next ubatch's maps may use it
        }
        copying = false;
        stats.bytes_copied += bytes;
        stats.n_copies += batch_keys.size();
        stats.n_copy_batches++;
        stats.n_copy_calls += n_calls;
        stats.copy_busy_us += (double) (t1 - t0);
    }
}

void llama_expert_pool::fill_every_slot() {
    // each layer's experts in consecutive slots: one run of copies per layer and kind
    const int64_t t0 = ggml_time_us();
    std::vector<int32_t> next(groups.size(), 0);
    uint64_t n_calls = 0;
    for (int32_t m = first_moe; m < end_moe; ++m) {
        group & g = groups[layer_group[m]];
        const int32_t slot0 = next[layer_group[m]];
        next[layer_group[m]] += n_expert;
        stats.bytes_copied += copy_experts(m, 0, n_expert, slot0, n_calls);
        for (int32_t e = 0; e < n_expert; ++e) {
            g.owner[slot0 + e] = m * n_expert + e;
            slot_of[m * n_expert + e] = slot0 + e;
        }
        stats.n_copies += n_expert;
        stats.n_copy_batches++;
    }
    finish_copies();
    for (auto & g : groups) {
        g.free_slots.clear();
    }
    stats.n_copy_calls += n_calls;
    stats.copy_busy_us += (double) (ggml_time_us() - t0);
    LLAMA_LOG_INFO("%s: every expert has a slot: %llu copied at load (%.1f MiB, %.2f s)\n", __func__,
                   (unsigned long long) stats.n_copies, stats.bytes_copied / 1048576.0, (ggml_time_us() - t0) * 1e-6);
}

void llama_expert_pool::pin_mapping() {
    // the file's range that holds every expert tensor, on 64 KiB boundaries (any page size)
    size_t lo = SIZE_MAX;
    size_t hi = 0;
    for (size_t m = 0; m < host.size(); ++m) {
        for (int k = 0; k < LLAMA_EXPERT_N_KINDS; ++k) {
            if (host[m][k] != nullptr) {
                lo = std::min(lo, file_offs[m][k]);
                hi = std::max(hi, file_offs[m][k] + (size_t) n_expert * expert_bytes(host[m][k]));
            }
        }
    }
    const size_t align = 64u << 10;
    lo = lo / align * align;
    hi = std::min(mapping->size(), (hi + align - 1) / align * align);
    uint8_t * base = (uint8_t *) mapping->addr() + lo;
    auto do_register = (bool (*)(void *, size_t)) ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(dev),
                                                                                     "ggml_backend_register_host_buffer");
    const int64_t t0 = ggml_time_us();
    if (do_register == nullptr || !do_register(base, hi - lo)) {
        LLAMA_LOG_WARN("%s: the file's %.1f MiB of experts are not pinned (%s %s): copies read pageable memory\n", __func__,
                       (hi - lo) / 1048576.0, ggml_backend_dev_name(dev),
                       do_register == nullptr ? "cannot register host memory" : "refused the registration");
        return;
    }
    pinned_mapping = base;
    stats.bytes_pinned = hi - lo;
    LLAMA_LOG_INFO("%s: the file's %.1f MiB of experts pinned for %s in %.2f s\n", __func__, (hi - lo) / 1048576.0,
                   ggml_backend_dev_name(dev), (ggml_time_us() - t0) * 1e-6);
}

size_t llama_expert_pool::copy_runs(int32_t m, const std::vector<int32_t> & keys, const std::vector<int32_t> & slots,
                                    uint64_t & n_calls) {
    size_t bytes = 0;
    for (size_t i = 0; i < keys.size();) {
        size_t n = 1;
        while (i + n < keys.size() && keys[i + n] == keys[i] + (int32_t) n && slots[i + n] == slots[i] + (int32_t) n) {
            n++;
        }
        bytes += copy_experts(m, keys[i], (int32_t) n, slots[i], n_calls);
        i += n;
    }
    return bytes;
}

void llama_expert_pool::finish_copies() {
    if (copy_backend != nullptr) {
        ggml_backend_synchronize(copy_backend);
    }
}

size_t llama_expert_pool::copy_experts(int32_t m, int32_t e, int32_t n, int32_t slot, uint64_t & n_calls) {
    const group & g = groups[layer_group[m]];
    size_t bytes = 0;
    for (int k = 0; k < LLAMA_EXPERT_N_KINDS; ++k) {
        ggml_tensor * dst = g.pool[k];
        if (!dst) {
            continue;
        }
        const size_t n_bytes = expert_bytes(host[m][k]);
        const uint8_t * src = copy_src[m][k] + (size_t) e * n_bytes;
        // queued on the worker's backend (else synchronous). A run in calls of up to 8 MiB when an
        // expert takes the same bytes on both sides (a slot is the host expert's layout): enough
        // for a link's full rate, and under the 10 MiB above which the RPC backend hashes every
        // set of a weight buffer to look it up in its cache (slower than the copy)
        const size_t max_call = 8u << 20;
        const int32_t per_call = expert_bytes(dst) == n_bytes ? (int32_t) std::clamp<size_t>(max_call / n_bytes, 1, n) : 1;
        for (int32_t i = 0; i < n; i += per_call) {
            const int32_t count = std::min(per_call, n - i);
            const size_t offset = (size_t) (slot + i) * expert_bytes(dst);
            if (copy_backend != nullptr) {
                ggml_backend_tensor_set_async(copy_backend, dst, src + (size_t) i * n_bytes, offset, (size_t) count * n_bytes);
            } else {
                ggml_backend_tensor_set(dst, src + (size_t) i * n_bytes, offset, (size_t) count * n_bytes);
            }
            n_calls++;
        }
        bytes += (size_t) n * n_bytes;
    }
    if (copy_delay_us > 0) { // tests: a slow link, per expert
        std::this_thread::sleep_for(std::chrono::microseconds((int64_t) copy_delay_us * n));
    }
    return bytes;
}

bool llama_expert_pool::wait_idle(int timeout_ms) {
    std::unique_lock<std::mutex> lk(mtx);
    return cv_idle.wait_for(lk, std::chrono::milliseconds(timeout_ms), [&] { return idle(); });
}

void llama_expert_pool::get_stats(spac_engine_stats & out) const {
    std::lock_guard<std::mutex> lk(mtx);
    out = stats;
    out.n_resident = 0;
    for (int32_t s : slot_of) {
        out.n_resident += s >= 0;
    }
}

void llama_expert_pool::reset_stats() {
    std::lock_guard<std::mutex> lk(mtx);
    const spac_engine_stats kept = stats; // what the pool is, not what it did
    stats = {};
    stats.n_slots = kept.n_slots;
    stats.bytes_pinned = kept.bytes_pinned;
}

void llama_expert_pool::get_residency(int32_t * slot) const {
    std::lock_guard<std::mutex> lk(mtx);
    std::memcpy(slot, slot_of.data(), slot_of.size() * sizeof(int32_t));
}
