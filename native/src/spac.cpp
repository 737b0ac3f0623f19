// spac C API (include/spac.h): thin wrappers over llama_expert_pool and the context's routing export

#include "spac.h"

#include "llama-context.h"
#include "llama-expert-pool.h"
#include "llama-experts-on-disk.h"
#include "llama-model.h"
#include "llama-mmap.h"

#include "ggml-backend.h"

#include <algorithm>
#include <atomic>
#include <chrono>

#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

struct spac_engine {
    llama_context     * lctx;
    llama_expert_pool * pool; // owned by the context
};

static void set_err(char * err, size_t err_len, const std::string & msg) {
    if (err != nullptr && err_len > 0) {
        snprintf(err, err_len, "%s", msg.c_str());
    }
}

spac_engine_params spac_engine_default_params(void) {
    spac_engine_params p = {};
    p.model_path       = nullptr;
    p.device           = nullptr;
    p.budget_bytes     = 0;
    p.budget_ratio     = 0.25f;
    p.max_split_tokens = 64;
    p.no_evict         = false;
    p.copy_delay_us    = 0;
    p.split_graph      = SPAC_SPLIT_OVERLAP;
    p.join             = SPAC_JOIN_AUTO;
    p.skip_absent      = false;
    p.only_half        = 0;
    p.stream_prefill   = SPAC_STREAM_OFF;
    p.layer_begin      = 0;
    p.layer_end        = 0;
    p.upload_on_miss_tokens = 0;
    p.copy_batch_experts = 8;
    p.pin_mapping = false;
    p.miss_gate_tokens = 0;
    return p;
}

spac_engine * spac_engine_create(llama_context * ctx, const spac_engine_params * params, char * err, size_t err_len) {
    if (ctx == nullptr || params == nullptr) {
        set_err(err, err_len, "context and params are required");
        return nullptr;
    }
    if (ctx->is_pool_draft()) {
        set_err(err, err_len, "this context is a pool draft");
        return nullptr;
    }
    try {
        auto pool = std::make_unique<llama_expert_pool>(*ctx, *params);
        llama_expert_pool * raw = pool.get();
        ctx->add_expert_pool(std::move(pool)); // throws when another engine holds these layers
        return new spac_engine { ctx, raw };
    } catch (const std::exception & e) {
        set_err(err, err_len, e.what());
        return nullptr;
    }
}

void spac_engine_free(spac_engine * engine) {
    if (engine == nullptr) {
        return;
    }
    engine->lctx->remove_expert_pool(engine->pool);
    delete engine;
}

int32_t spac_engine_n_moe_layers (const spac_engine * engine) { return engine->pool->n_moe_layers(); }
int32_t spac_engine_moe_begin    (const spac_engine * engine) { return engine->pool->moe_begin(); }
int32_t spac_engine_moe_end      (const spac_engine * engine) { return engine->pool->moe_end(); }
int32_t spac_engine_n_expert     (const spac_engine * engine) { return engine->pool->n_expert; }
int32_t spac_engine_n_expert_used(const spac_engine * engine) { return engine->pool->n_expert_used; }

int32_t spac_engine_set_plan(spac_engine * engine, const uint8_t * utility, const int32_t * threshold,
                             const int32_t * prefetch, int32_t n_prefetch,
                             const int32_t * evict, int32_t n_evict, char * err, size_t err_len) {
    std::string msg;
    const int32_t rc = engine->pool->set_plan(utility, threshold, prefetch, n_prefetch, evict, n_evict, msg);
    if (rc != 0) {
        set_err(err, err_len, msg);
    }
    return rc;
}

int32_t spac_engine_set_miss_costs(spac_engine * engine, const spac_miss_costs * costs, char * err, size_t err_len) {
    std::string msg;
    if (!engine->pool->set_miss_costs(costs, msg)) {
        set_err(err, err_len, msg);
        return -1;
    }
    return 0;
}

int32_t spac_engine_wait_idle(spac_engine * engine, int32_t timeout_ms) {
    return engine->pool->wait_idle(timeout_ms) ? 1 : 0;
}

void spac_engine_get_stats(const spac_engine * engine, spac_engine_stats * stats) {
    engine->pool->get_stats(*stats);
}

void spac_engine_reset_stats(spac_engine * engine) {
    engine->pool->reset_stats();
}

void spac_engine_get_residency(const spac_engine * engine, int32_t * slot) {
    engine->pool->get_residency(slot);
}

void spac_routing_enable(llama_context * ctx, bool enable) {
    ctx->set_routing_export(enable);
}

int32_t spac_graph_n_splits(llama_context * ctx) {
    ctx->synchronize();
    return ggml_backend_sched_get_n_splits(ctx->get_sched());
}

int32_t spac_graph_n_crossings(llama_context * ctx) {
    return spac_graph_crossings_text(ctx, nullptr, 0);
}

int32_t spac_graph_crossings_text(llama_context * ctx, char * buf, size_t size) {
    ctx->synchronize();
    ggml_cgraph * gf = ctx->last_graph();
    if (buf != nullptr && size > 0) {
        buf[0] = '\0';
    }
    if (gf == nullptr) {
        return 0;
    }
    int32_t n = 0;
    std::string text;
    ggml_backend_t prev = nullptr;
    const ggml_tensor * prev_node = nullptr;
    for (int i = 0; i < ggml_graph_n_nodes(gf); ++i) {
        ggml_tensor * node = ggml_graph_node(gf, i);
        if (node->op == GGML_OP_NONE || node->op == GGML_OP_VIEW || node->op == GGML_OP_RESHAPE ||
            node->op == GGML_OP_PERMUTE || node->op == GGML_OP_TRANSPOSE) {
            continue;
        }
        ggml_backend_t b = ggml_backend_sched_get_tensor_backend(ctx->get_sched(), node);
        if (prev != nullptr && b != nullptr && b != prev) {
            n++;
            if (buf != nullptr) {
                text += std::string(text.empty() ? "" : "; ") + ggml_get_name(prev_node) + " (" + ggml_backend_name(prev) +
                        ") -> " + ggml_get_name(node) + " (" + ggml_backend_name(b) + ")";
            }
        }
        if (b != nullptr) {
            prev = b;
            prev_node = node;
        }
    }
    if (buf != nullptr && size > 0) {
        snprintf(buf, size, "%s", text.c_str());
    }
    return n;
}

int32_t spac_routing_n_moe_layers(const llama_context * ctx) {
    return (int32_t) llama_moe_layers(ctx->get_model()).size();
}

void spac_set_embeddings_nextn(llama_context * ctx, bool enable, bool masked) {
    ctx->set_embeddings_nextn(enable, masked);
}

const float * spac_get_embeddings_nextn(llama_context * ctx) {
    return ctx->get_embeddings_nextn();
}

const float * spac_get_embeddings_nextn_ith(llama_context * ctx, int32_t i) {
    return ctx->get_embeddings_nextn_ith(i);
}

int32_t spac_engine_attach_draft(spac_engine * engine, llama_context * draft, char * err, size_t err_len) {
    if (engine == nullptr || draft == nullptr) {
        set_err(err, err_len, "engine and draft context are required");
        return -1;
    }
    try {
        engine->pool->attach_draft(draft);
        return 0;
    } catch (const std::exception & e) {
        set_err(err, err_len, e.what());
        return -1;
    }
}

void spac_engine_detach_draft(spac_engine * engine, llama_context * draft) {
    if (engine != nullptr && draft != nullptr) {
        engine->pool->detach_draft(draft);
    }
}

int32_t spac_routing_get_unmasked(llama_context * ctx, const int32_t ** ids) {
    ctx->synchronize();
    if (!ctx->is_pool_draft() || ctx->routing_ids_unmasked.empty()) {
        *ids = nullptr;
        return 0;
    }
    *ids = ctx->routing_ids_unmasked.data();
    return ctx->routing_n_tokens;
}

int32_t spac_routing_get(llama_context * ctx, const int32_t ** ids, const float ** weights) {
    ctx->synchronize(); // the routing of the last decode is copied asynchronously
    *ids     = ctx->routing_ids.data();
    *weights = ctx->routing_weights.data();
    return ctx->routing_n_tokens;
}

int32_t spac_model_plain_twins(llama_model * model, const char * model_path, int32_t min_tokens,
                               const int32_t * expert_types, int32_t n_expert_types,
                               const int32_t * dense_types, int32_t n_dense_types, char * err, size_t err_len) {
    if (model == nullptr || min_tokens < 1 || n_expert_types < 0 || (n_expert_types > 0 && expert_types == nullptr) ||
        n_dense_types < 0 || (n_dense_types > 0 && dense_types == nullptr)) {
        set_err(err, err_len, "model, min_tokens >= 1 and the types are required");
        return -1;
    }
    auto * cpu_dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (cpu_dev == nullptr) {
        set_err(err, err_len, "no CPU backend");
        return -1;
    }
    try {
        auto twins = std::make_unique<llama_plain_twins>();
        twins->min_tokens = min_tokens;
        ggml_init_params ip = { (model->copied_source.size() + 1) * ggml_tensor_overhead(), nullptr, /*no_alloc =*/ true };
        twins->ctx.reset(ggml_init(ip));
        // a host buffer over a mapping; a twin is a tensor at its weight's address in it
        auto wrap = [&](void * addr, size_t size) {
            twins->bufs.emplace_back(ggml_backend_dev_buffer_from_host_ptr(cpu_dev, addr, size, size));
            if (!twins->bufs.back()) {
                throw std::runtime_error("the CPU backend cannot wrap the model file's mapping in a buffer");
            }
            return twins->bufs.back().get();
        };
        std::vector<ggml_backend_buffer_t> model_bufs;
        for (const auto & [addr, size] : model->mapped_files) {
            model_bufs.push_back(wrap(addr, size));
        }
        for (const auto & [name, t] : model->tensors_by_name) {
            auto src = model->copied_source.find(t);
            const bool      expert = ggml_n_dims(t) >= 3;
            const int32_t * types  = expert ? expert_types : dense_types;
            const int32_t   n_kind = expert ? n_expert_types : n_dense_types;
            const bool      wanted = std::find(types, types + n_kind, (int32_t) t->type) != types + n_kind;
            // a weight copied to a GPU is not the host's to twin: a prompt would read it back from the host
            const bool on_host = t->buffer && ggml_backend_buft_get_device(ggml_backend_buffer_get_type(t->buffer)) == cpu_dev;
            if (src == model->copied_source.end() || !wanted || !on_host) {
                continue;
            }
            const auto & w = src->second;
            ggml_backend_buffer_t buf = nullptr;
            const uint8_t * data = (const uint8_t *) w.mapped;
            if (data != nullptr && w.idx < model_bufs.size()) {
                buf = model_bufs[w.idx];
            } else if (w.idx == 0 && model_path != nullptr) {
                // bytes llama.cpp unmapped after loading (outside the range its mmap buffers use):
                // map the file once more; its pages become resident only when a prompt reads them
                if (!twins->mapping) {
                    twins->file    = std::make_unique<llama_file>(model_path, "rb");
                    twins->mapping = std::make_unique<llama_mmap>(twins->file.get(), /*prefetch =*/ 0, false);
                    wrap(twins->mapping->addr(), twins->mapping->size());
                }
                buf  = twins->bufs.back().get();
                data = (const uint8_t *) twins->mapping->addr() + w.offs;
            } else {
                continue; // a split model's later file, not mapped: this weight keeps its repacked layout
            }
            ggml_tensor * twin = ggml_dup_tensor(twins->ctx.get(), t);
            ggml_format_name(twin, "%s (plain)", name.c_str());
            if (ggml_backend_tensor_alloc(buf, twin, (void *) data) != GGML_STATUS_SUCCESS) {
                throw std::runtime_error("cannot place the plain twin of " + name);
            }
            twins->twin[t] = twin;
        }
        const int32_t n = (int32_t) twins->twin.size();
        model->plain_twins = n > 0 ? std::move(twins) : nullptr;
        return n;
    } catch (const std::exception & e) {
        set_err(err, err_len, e.what());
        return -1;
    }
}

static const ggml_tensor * model_tensor(const llama_model * model, const char * name) {
    for (const auto & [n, t] : model->tensors_by_name) {
        if (n == name) {
            return t;
        }
    }
    return nullptr;
}

const char * spac_model_layer_device(const llama_model * model, int32_t il) {
    if (model == nullptr || il < 0 || il >= (int32_t) model->hparams.n_layer()) {
        return nullptr;
    }
    ggml_backend_dev_t dev = model->dev_layer(il);
    return dev != nullptr ? ggml_backend_dev_name(dev) : nullptr;
}

const char * spac_model_tensor_buft(const llama_model * model, const char * name) {
    const ggml_tensor * t = model && name ? model_tensor(model, name) : nullptr;
    return t && t->buffer ? ggml_backend_buft_name(ggml_backend_buffer_get_type(t->buffer)) : nullptr;
}

const char * spac_model_tensor_twin_buft(const llama_model * model, const char * name) {
    const ggml_tensor * t = model && name && model->plain_twins ? model_tensor(model, name) : nullptr;
    if (t == nullptr) {
        return nullptr;
    }
    auto it = model->plain_twins->twin.find(t);
    return it == model->plain_twins->twin.end() ? nullptr : ggml_backend_buft_name(ggml_backend_buffer_get_type(it->second->buffer));
}

// The sum of n words read as S streams side by side (S equal parts of the range, a cache line of
// each in turn), each line asked for AHEAD bytes early (0: the hardware prefetchers alone): the ways a
// kernel can read a weight, whose fastest is the machine's read rate. Eight independent chains of
// adds per stream: the loads, never the adds, are the bottleneck.
template <int S, int AHEAD>
static uint64_t sum_words(const uint64_t * w, size_t n) {
    uint64_t acc[S][8] = {};
    const size_t len = n / S / 8 * 8;
    for (size_t i = 0; i < len; i += 8) {
        for (int c = 0; c < S; ++c) {
            const uint64_t * p = w + c * len + i;
            if (AHEAD > 0) {
                __builtin_prefetch((const char *) p + AHEAD);
            }
            for (int k = 0; k < 8; ++k) {
                acc[c][k] += p[k];
            }
        }
    }
    uint64_t sum = 0;
    for (const auto & a : acc) {
        for (uint64_t v : a) {
            sum += v;
        }
    }
    return sum;
}

// bytes/s of n_threads threads each reading its share of buf with `sum`, the best of a few passes
static double read_rate(const std::vector<uint64_t> & buf, int32_t n_threads, uint64_t (*sum)(const uint64_t *, size_t),
                        std::vector<uint64_t> & sums) {
    const size_t n_words = buf.size();
    double best = 0.0;
    for (int pass = 0; pass < 3; ++pass) {
        std::atomic<int>  ready{ 0 };
        std::atomic<bool> go{ false };
        std::vector<std::thread> threads;
        for (int32_t t = 0; t < n_threads; ++t) {
            threads.emplace_back([&, t] {
                const size_t lo = n_words * t / n_threads, hi = n_words * (t + 1) / n_threads;
                ready.fetch_add(1);
                while (!go.load(std::memory_order_acquire)) {
                }
                sums[t] += sum(buf.data() + lo, hi - lo);
            });
        }
        while (ready.load() < n_threads) {
        }
        const auto t0 = std::chrono::steady_clock::now();
        go.store(true, std::memory_order_release);
        for (auto & th : threads) {
            th.join();
        }
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        best = std::max(best, (double) (n_words * sizeof(uint64_t)) / std::max(s, 1e-9));
    }
    return best;
}

double spac_host_read_rate(int32_t n_threads, size_t n_bytes) {
    n_threads = std::max<int32_t>(n_threads, 1);
    std::vector<uint64_t> buf;
    try {
        buf.assign(n_bytes / sizeof(uint64_t), 1);  // written, so that every page is backed
    } catch (const std::bad_alloc &) {
        return 0.0;
    }
    uint64_t (*const ways[])(const uint64_t *, size_t) = {
        sum_words<1, 0>, sum_words<1, 1024>, sum_words<1, 2048>, sum_words<1, 4096>,
        sum_words<4, 0>, sum_words<4, 1024>, sum_words<4, 2048>, sum_words<4, 4096>,
    };
    std::vector<uint64_t> sums((size_t) n_threads);
    double best = 0.0;
    for (auto * way : ways) {
        best = std::max(best, read_rate(buf, n_threads, way, sums));
    }
    volatile uint64_t sink = 0;  // the sums are used: the reads cannot be dropped
    for (uint64_t v : sums) {
        sink = sink + v;
    }
    return best;
}

bool spac_model_experts_on_disk(const llama_model * model) {
    return model != nullptr && model->experts_on_disk != nullptr;
}

// the model layer of the routing export's MoE layer m, -1 out of range
static int moe_layer_il(const llama_model * model, int32_t m) {
    const std::vector<int> & il = model->experts_on_disk->moe_layers;
    return m >= 0 && m < (int32_t) il.size() ? il[m] : -1;
}

int32_t spac_disk_advise(llama_model * model, const int32_t * layer_expert, int32_t n, int32_t advice) {
    if (!spac_model_experts_on_disk(model)) {
        return -1;
    }
    int32_t n_valid = 0;
    for (int32_t i = 0; i < n; ++i) {
        n_valid += model->experts_on_disk->advise(moe_layer_il(model, layer_expert[2*i]), layer_expert[2*i + 1], advice);
    }
    return n_valid;
}

int32_t spac_disk_missing(const llama_model * model, const int32_t * layer_expert, int32_t n, int64_t * missing) {
    if (!spac_model_experts_on_disk(model)) {
        return -1;
    }
    for (int32_t i = 0; i < n; ++i) {
        missing[i] = model->experts_on_disk->missing_bytes(moe_layer_il(model, layer_expert[2*i]), layer_expert[2*i + 1]);
    }
    return n;
}

void spac_disk_set_on_device(llama_model * model, const uint8_t * on_device) {
    if (spac_model_experts_on_disk(model)) {
        model->experts_on_disk->set_on_device(on_device);
    }
}

void spac_disk_get_stats(const llama_model * model, spac_disk_stats * stats) {
    *stats = {};
    if (spac_model_experts_on_disk(model)) {
        model->experts_on_disk->get_stats(*stats);
    }
}

void spac_disk_reset_stats(llama_model * model) {
    if (spac_model_experts_on_disk(model)) {
        model->experts_on_disk->reset_stats();
    }
}
