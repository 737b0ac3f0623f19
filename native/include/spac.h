#pragma once

// spac: a device-resident expert pool for MoE models, split CPU/device execution of every
// MoE layer, routing export and a per-step plan API. C linkage, so ctypes binds it as is.
//
// Lifecycle: load a model and a context with llama.h as usual, then spac_engine_create() on
// that context. From then on every decode of the context computes each MoE layer's resident
// experts on the pool device and the others on the CPU, and the copy engine (a native worker
// thread) serves the plan given by spac_engine_set_plan(). spac_engine_free() detaches it;
// the context behaves exactly as upstream again.
//
// Several devices: one engine per device on the same context, each given the model layers
// whose experts it holds (layer_begin/layer_end: the layers llama.cpp placed on that device,
// spac_model_layer_device). The engines share the plan's shape: each takes its own layers'
// part of every plan and counts its own stats.

#include "llama.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct spac_engine spac_engine;

struct spac_engine_params {
    const char * model_path;    // the GGUF the context's model was loaded from: experts are
                                // copied into the pool from the file's layout (host tensors
                                // may be repacked for the CPU kernels)
    const char * device;        // ggml device name for the pool (e.g. "CUDA0", "RPC0[127.0.0.1:50052]");
                                // NULL or "CPU" = a second CPU buffer (the bit-exact test device)
    uint64_t     budget_bytes;  // pool size in bytes; 0 = use budget_ratio
    float        budget_ratio;  // pool size as a share of all expert bytes (0..1]
    int32_t      max_split_tokens; // ubatches larger than this keep upstream's unsplit graph (prompt processing); <= 0: 64
    bool         no_evict;      // ablation: never evict, only fill free slots
    int32_t      copy_delay_us; // test only: sleep this long inside every expert copy
    int32_t      split_graph;   // enum spac_split_graph
    int32_t      join;          // enum spac_join
    bool         skip_absent;   // the pool device skips id -1 in MUL_MAT_ID/ADD_ID like ggml-cpu does
                                // (an RPC server running this patch series): non-resident rows are
                                // skipped there instead of multiplied by the all-zero slot. A CPU
                                // pool always skips.
    int32_t      only_half;     // benchmarks only: 1 = leave the host half out of the graph, 2 = the
                                // device half (outputs are wrong; times one half alone); 0 = both
    int32_t      stream_prefill; // enum spac_stream_prefill: a ubatch above max_split_tokens computes
                                // its experts on the pool device, the non-resident ones copied into
                                // staging slots (two layers of experts besides the pool). Off when
                                // they do not fit or the device has no events (logged once).
    int32_t      layer_begin;   // the model layers [layer_begin, layer_end) whose experts this pool
    int32_t      layer_end;     // holds (the others: another device's engine, or the host);
                                // layer_end <= 0: every layer from layer_begin
    int32_t      upload_on_miss_tokens; // ablation, llama.cpp's own expert cache: a ubatch of at most
                                // this many tokens uploads, at each MoE layer once its router has run,
                                // the chosen experts the pool lacks into its least recently used slots
                                // (hits touched first, then the misses in ascending ids), and computes
                                // every routed expert on the pool device. The pool becomes an LRU cache
                                // (send no plans). 0: off; needs room for the staging slots (logged).
    int32_t      copy_batch_experts; // a plan's copies go in batches of up to this many experts of one
                                // layer, queued on the copy worker's own backend of the device (its
                                // own stream on a GPU) with one synchronize per batch (a staged
                                // layer's copies too); 1: synchronous copies, each expert's on its
                                // own (as before patch 0024); <= 0: 8
    bool         pin_mapping;   // register the file mapping's expert range as pinned host memory of
                                // the device (ggml's host-buffer registration; ggml-cuda's asks for
                                // GGML_CUDA_REGISTER_HOST in the environment): a GPU then copies the
                                // mapped file at the pinned rate with no second copy of the weights.
                                // Pins (and so reads in) the whole range; logged when the device
                                // cannot or refuses; nothing when the model's copy is pinned already
    int32_t      miss_gate_tokens; // spac's miss rule: a split ubatch of at most this many tokens decides,
                                // at each MoE layer once its router has run, where each chosen expert the
                                // pool lacks computes: uploaded into a slot (the victim: llama.cpp master's
                                // ClassLRU), on the host, or streamed once through its staging slot when
                                // no slot may go (only where streamed prefill has staging slots). The
                                // costs come from spac_engine_set_miss_costs; until then every miss is the
                                // host's. 0: off (every miss on the host, the plan's residency only)
};

// spac's miss rule (miss_gate_tokens): a layer's misses, hottest first, are uploaded while the
// upload and the device's compute finish no later than the host would the coldest, plus the host
// time the expert's later uses are expected to save once it is resident (its decayed use count
// over the count of an expert every token uses, times horizon_tokens, times one token's host-minus-
// device time). Times in microseconds; [i] is one expert computed for i + 1 tokens.
#define SPAC_MISS_MAX_TOKENS 64
struct spac_miss_costs {
    float upload_us;       // one expert host -> pool device
    float sync_us;         // the device half's wait for the gate (the router's ids read back)
    float horizon_tokens;  // an upload's credit; 0: none (HybriMoE's greedy within the pass)
    float host_us  [SPAC_MISS_MAX_TOKENS];
    float device_us[SPAC_MISS_MAX_TOKENS];
};

enum spac_stream_prefill {
    SPAC_STREAM_OFF   = 0, // upstream's prefill (experts on the host, or op offload)
    SPAC_STREAM_AHEAD = 1, // every non-resident expert of the next layer, copied while a layer computes
    SPAC_STREAM_USED  = 2, // only the experts the layer's router chose, copied once it has run
};

enum spac_split_graph {
    SPAC_SPLIT_OVERLAP    = 0, // each MoE layer: device experts entirely on the device, host experts
                               // entirely on the host, the device half queued first; one crossing each way
    SPAC_SPLIT_PER_MATMUL = 1, // every expert matmul split and summed at once (halves one after the other)
};

enum spac_join {
    SPAC_JOIN_AUTO         = 0, // per expert on a CPU pool, partial sums on a device
    SPAC_JOIN_PER_EXPERT   = 1, // the halves' per-expert rows are added, then weighted and summed as
                                // upstream does: bit-identical to the unsplit layer
    SPAC_JOIN_PARTIAL_SUMS = 2, // each half weights and sums its own experts, one [n_embd, n_tokens]
                                // crosses; the sum order differs from upstream's (rounding only)
};

struct spac_engine_stats {
    uint64_t n_expert_tokens_device; // (token, expert) computations done on the pool device
    uint64_t n_expert_tokens_cpu;    // ... and on the CPU
    uint64_t bytes_copied;           // host -> pool bytes
    uint64_t n_copies;               // experts copied
    uint64_t n_evictions;
    uint64_t n_prefetch_late;        // wanted by the plan, still not resident when a verify started
    double   copy_busy_us;           // time the copy worker spent copying
    int32_t  n_slots;                // pool slots (without the zero slots)
    int32_t  n_resident;             // experts resident now
    uint64_t n_staged;               // streamed prefill: experts copied into staging slots
    uint64_t bytes_staged;
    double   stage_copy_us;          // time the copy worker spent on them
    double   stage_wait_us;          // time the graph waited for them (copies not hidden by compute)
    uint64_t n_copy_calls;           // host -> device copy calls (one per tensor of a run of consecutive
                                     // experts, as a streamed layer's are; a plan's copies one each)
    uint64_t n_copy_batches;         // a plan's copies: batches (one layer's experts, one synchronize);
                                     // copy_busy_us / n_copy_batches is the time of one
    uint64_t n_stage_batches;        // staged layers (streamed prefill, upload on miss): one batch
                                     // each; stage_copy_us / n_stage_batches is one layer's copy time
    uint64_t bytes_pinned;           // the file mapping's bytes registered as pinned memory (pin_mapping)
    uint64_t n_gate_uploads;         // the miss rule's choices (miss_gate_tokens), distinct experts per layer
    uint64_t n_gate_host;            // and pass: uploaded into a slot, computed on the host, streamed
    uint64_t n_gate_streamed;        // through a staging slot (uploads and streams also count as staged)
};

struct spac_engine_params spac_engine_default_params(void);

// NULL on error, with the reason in err (if err_len > 0)
spac_engine * spac_engine_create(struct llama_context * ctx, const struct spac_engine_params * params,
                                 char * err, size_t err_len);
void          spac_engine_free(spac_engine * engine);  // stops the copy worker, frees the pool

int32_t spac_engine_n_moe_layers(const spac_engine * engine);
// the MoE layers [begin, end) whose experts this engine's pool holds (its layer_begin/layer_end)
int32_t spac_engine_moe_begin   (const spac_engine * engine);
int32_t spac_engine_moe_end     (const spac_engine * engine);
int32_t spac_engine_n_expert    (const spac_engine * engine);
int32_t spac_engine_n_expert_used(const spac_engine * engine);

// One call per verification step. utility: uint8 [n_moe_layers * n_expert] (layer-major),
// threshold: int32 [n_moe_layers] (tau). Experts with utility >= tau are prefetched, the highest
// utility first (FIFO by layer within a level); residents are evicted lowest utility first.
// prefetch / evict (optional, may be NULL): int32 pairs (moe layer, expert) in priority order;
// prefetch replaces the utility ranking, evict gives the eviction order. 0 on success,
// -1 on bad arguments (message in err).
int32_t spac_engine_set_plan(spac_engine * engine, const uint8_t * utility, const int32_t * threshold,
                             const int32_t * prefetch, int32_t n_prefetch,
                             const int32_t * evict, int32_t n_evict, char * err, size_t err_len);

// the miss rule's costs (miss_gate_tokens), from the next ubatch on; 0 on success, -1 on bad
// values (message in err). NULL: no costs, every miss on the host again.
int32_t spac_engine_set_miss_costs(spac_engine * engine, const struct spac_miss_costs * costs, char * err, size_t err_len);

// block until the copy worker has nothing left to do (or timeout); 1 = idle, 0 = timed out
int32_t spac_engine_wait_idle(spac_engine * engine, int32_t timeout_ms);

void spac_engine_get_stats(const spac_engine * engine, struct spac_engine_stats * stats);
void spac_engine_reset_stats(spac_engine * engine);

// residency snapshot: slot: int32 [n_moe_layers * n_expert], pool slot of each expert or -1
void spac_engine_get_residency(const spac_engine * engine, int32_t * slot);

// Pool draft: a second context on the engine's model (llama.cpp contexts share a model's
// weights; only its KV cache is new) becomes a draft that costs no expert memory. Its MoE
// layers route each token only among the experts resident in the pool (the router's
// selection scores of the others set to -inf before top-k; the routing weights follow from
// the chosen experts as the architecture computes them) and compute on the pool device alone,
// every ubatch, through the same residency maps; the slots its ubatches use are frozen like
// the engine context's. With the routing export on, spac_routing_get returns the masked
// choice and spac_routing_get_unmasked what the unmasked router chose (a lookahead). If fewer
// experts than n_expert_used are resident in a layer, the rest of its choice is non-resident
// experts, which contribute zero. 0 on success, -1 with the reason in err. The draft is
// detached by spac_engine_detach_draft, spac_engine_free or freeing the draft context.
int32_t spac_engine_attach_draft(spac_engine * engine, struct llama_context * draft, char * err, size_t err_len);
void    spac_engine_detach_draft(spac_engine * engine, struct llama_context * draft);

// Routing export (works with or without an engine): after each decode, the experts every token
// selected in every MoE layer and their routing weights, layer-major:
//   ids [n_moe_layers][n_tokens][n_expert_used], weights the same shape.
// spac_routing_get waits for the decode, returns its n_tokens and points *ids / *weights at the
// arrays, which stay valid until the next decode on the context. One call: it runs every step.
void    spac_routing_enable      (struct llama_context * ctx, bool enable);
// the context's last computed graph: scheduler splits (runs on one backend each), and crossings
// (changes of backend from one compute node to the next, in graph order)
int32_t spac_graph_n_splits   (struct llama_context * ctx);
int32_t spac_graph_n_crossings(struct llama_context * ctx);
// the same crossings named, "node (backend) -> node (backend)" separated by "; ", written into
// buf (truncated to size, NUL-terminated); returns the number of crossings
int32_t spac_graph_crossings_text(struct llama_context * ctx, char * buf, size_t size);

int32_t spac_routing_n_moe_layers(const struct llama_context * ctx);

// Plain twins of repacked weights: every host tensor the loader copied into another layout
// (CPU_REPACK, CPU_EXACT, AMX) whose ggml type is in expert_types[0..n_expert_types) (routed experts:
// 3-D tensors) or dense_types[0..n_dense_types) (2-D) and whose file bytes are still mapped (mmap) gets
// a twin over those bytes, in place (no copy, no new memory: llama.cpp keeps the mapping). A matmul
// of at least min_tokens activation rows (a prompt's ubatch; MoE layers the expert pool splits
// excepted) then reads the twin: the plain CPU kernels, faster than the repacked ones on large
// batches for some types, and a host buffer, which a GPU's op offload can take. Call it before the
// model's first decode; a second call replaces the twins. Returns the number of twinned tensors, -1
// with the reason in err. model_path: the model's file, mapped once more for weights whose bytes
// llama.cpp unmapped after loading (NULL: those keep their repacked layout).
int32_t spac_model_plain_twins(struct llama_model * model, const char * model_path, int32_t min_tokens,
                               const int32_t * expert_types, int32_t n_expert_types,
                               const int32_t * dense_types, int32_t n_dense_types, char * err, size_t err_len);

// The ggml device llama.cpp placed model layer il on ("CPU" for a layer left on the host); NULL
// when il is out of range.
const char * spac_model_layer_device(const struct llama_model * model, int32_t il);

// The buffer type a model weight was loaded into ("CPU", "CPU_REPACK", "CUDA0", ...), and that of
// its plain twin (NULL without one); NULL for no such tensor.
const char * spac_model_tensor_buft      (const struct llama_model * model, const char * name);
const char * spac_model_tensor_twin_buft (const struct llama_model * model, const char * name);
int32_t spac_routing_get         (struct llama_context * ctx, const int32_t ** ids, const float ** weights);
// pool draft context only: the unmasked router's top-k of the last decode, the shape of ids;
// n_tokens, or 0 (and *ids NULL) when the context is no pool draft
int32_t spac_routing_get_unmasked(struct llama_context * ctx, const int32_t ** ids);

// The MTP draft (a target's multi-token-prediction head, run in a LLAMA_CONTEXT_TYPE_MTP context on
// the same model): llama.cpp's nextn hidden states, which its C++ staging header src/llama-ext.h
// declares without C linkage. Enabled on the target's context with masked = false, each decode keeps
// the hidden state of every token of its batch, in batch order (the rows an MTP context pairs with
// the next tokens); on an MTP context with masked = true, those of the outputs only (its own state,
// for the next drafted token). spac_get_embeddings_nextn: [n_rows][n_embd_out] of the last decode;
// _ith: the row of batch index i (masked: of output i); NULL when disabled or out of range.
void          spac_set_embeddings_nextn    (struct llama_context * ctx, bool enable, bool masked);
const float * spac_get_embeddings_nextn    (struct llama_context * ctx);
const float * spac_get_embeddings_nextn_ith(struct llama_context * ctx, int32_t i);

// A model larger than RAM: loaded with llama_model_params.lazy_mode = LLAMA_LAZY_MODE_EXPERTS, its
// routed experts stay in the file mapping, read from the disk only when used; each MoE layer's gate
// asks for the chosen experts not in memory all at once (its stalls) before the matmuls touch them.
// The host tier keeps some in memory: spac_disk_advise(SPAC_DISK_READ) reads experts in the
// background (a read ahead), SPAC_DISK_DROP drops their pages. Pairs are (MoE layer, expert), the
// MoE layer counted as in the routing export (spac_routing_get).
enum spac_disk_advice {
    SPAC_DISK_READ = 0,
    SPAC_DISK_DROP = 1,
};

struct spac_disk_stats {
    uint64_t n_gate_experts;   // distinct experts the MoE layers' gates saw (per layer and ubatch)
    uint64_t n_stalls;         // of those, not wholly in memory at the gate: the layer waited for the disk
    uint64_t bytes_stalled;    // their bytes not in memory then
    uint64_t n_read_ahead;     // experts asked for by SPAC_DISK_READ that were not wholly in memory
    uint64_t bytes_read_ahead; // their bytes not in memory then
    uint64_t n_dropped;        // experts given SPAC_DISK_DROP
    uint64_t gate_advise_ns;   // time the gates' threads spent asking for the stalls' bytes (madvise
                               // WILLNEED: in a full memory cgroup it charges and reclaims), summed
};

// true when the model's routed experts are read from the disk (LLAMA_LAZY_MODE_EXPERTS)
bool    spac_model_experts_on_disk(const struct llama_model * model);
// layer_expert: n pairs; returns how many were valid, -1 when the experts are not on the disk
int32_t spac_disk_advise(struct llama_model * model, const int32_t * layer_expert, int32_t n, int32_t advice);
// missing[i]: bytes of pair i not in memory now (0: all in memory; -1: no such pair); returns -1
// when the experts are not on the disk
int32_t spac_disk_missing(const struct llama_model * model, const int32_t * layer_expert, int32_t n, int64_t * missing);
// on_device: [n_moe_layers][n_expert] bytes, 1 for an expert a device pool holds (the gates leave
// it to the device); NULL: none. Copied; a stale entry costs a read, never a wrong result.
void    spac_disk_set_on_device(struct llama_model * model, const uint8_t * on_device);
void    spac_disk_get_stats  (const struct llama_model * model, struct spac_disk_stats * stats);
void    spac_disk_reset_stats(struct llama_model * model);

// Bytes per second that n_threads threads read from host memory together, each its share of an
// n_bytes buffer: the best of a few passes of each way of reading (one stream or four side by side,
// the hardware prefetchers alone or software prefetch 1-4 KiB ahead). The limit a memory-bound CPU
// kernel's decode is held to (bench/bench_cpu.py). Make n_bytes several times the last-level
// cache. 0 if it cannot allocate.
double spac_host_read_rate(int32_t n_threads, size_t n_bytes);

#ifdef __cplusplus
}
#endif
