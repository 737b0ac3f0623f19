#pragma once

// Device-resident expert pool and its copy engine (spac).
//
// All experts stay in host RAM; the pool holds copies of the hot ones on a device. Each MoE
// layer is computed in two halves summed in the graph: MUL_MAT_ID on the pool with ids
// remapped through a per-layer map (non-resident -> an all-zero slot), and MUL_MAT_ID on the
// host experts with the resident experts' ids replaced by -1 (skipped by ggml-cpu). The maps
// are graph inputs filled every ubatch, so a new plan never rebuilds the graph.
//
// Slots: a slot becomes visible to a graph only after its copy completed; slots referenced
// by a graph are frozen until the context synchronizes.

#include "llama.h"
#include "spac.h"

#include "ggml-backend.h"

#include <array>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

struct llama_context;
struct llama_model;
struct llama_file;
struct llama_mmap;

// the per-expert tensors a MoE layer may have (matrices, biases, scales); the pool mirrors each
// one present, the expert index being the tensor's last dimension
enum llama_expert_kind {
    LLAMA_EXPERT_UP, LLAMA_EXPERT_GATE, LLAMA_EXPERT_DOWN, LLAMA_EXPERT_GATE_UP,
    LLAMA_EXPERT_UP_B, LLAMA_EXPERT_GATE_B, LLAMA_EXPERT_DOWN_B, LLAMA_EXPERT_GATE_UP_B,
    LLAMA_EXPERT_UP_S, LLAMA_EXPERT_GATE_S, LLAMA_EXPERT_DOWN_S,
    LLAMA_EXPERT_N_KINDS,
};

struct llama_expert_pool;

// the pools a context's graphs read: one per device, each holding the experts of a contiguous
// range of MoE layers (with several devices, the layers llama.cpp placed on that device)
struct llama_expert_pools {
    std::vector<llama_expert_pool *> pools;    // not owned
    std::vector<ggml_backend_t>      backends; // each pool's device backend in the graph's context (nullptr: the CPU's)

    bool empty() const { return pools.empty(); }
    int find(int il) const; // the pool holding model layer il's experts, -1 if none
};

struct llama_expert_pool {
    // layers whose expert tensors share types and shapes share one group of slots
    struct group {
        std::array<ggml_tensor *, LLAMA_EXPERT_N_KINDS> pool = {}; // [..., n_slots + n_map_positions]; slots from n_slots stay zero
        int32_t n_slots = 0;
        int32_t absent  = 0;          // dev map value of a non-resident expert: the first zero slot, or -1 on a CPU pool
        size_t  slot_bytes = 0;
        std::vector<int32_t> owner;   // slot -> key (moe layer * n_expert + expert), -1 free, -2 being copied
        std::vector<uint8_t> frozen;  // slot -> referenced by a graph that may still run (FROZEN_* bits)
        std::vector<int32_t> free_slots;
        int32_t no_room_below = -1;   // this plan found no slot for a request of this utility: skip those <= it
        int32_t staging = 0;          // first of the 2 * n_expert staging slots (streamed prefill), after the zero slots
        std::vector<uint64_t> last_use; // slot -> when a cached ubatch last routed to it (the LRU's clock)
    };

    llama_expert_pool(llama_context & lctx, const spac_engine_params & params); // throws std::runtime_error
    ~llama_expert_pool();
    llama_context & context() const { return lctx; }

    // model shape
    int32_t n_moe_layers() const { return (int32_t) layer_il.size(); }
    int32_t moe_index(int il) const { return il < (int) moe_of_il.size() ? moe_of_il[il] : -1; }
    // the MoE layers [moe_begin, moe_end) whose experts this pool holds; the indices (maps, plans,
    // keys) stay the model's, so that the pools of several devices share one plan and one map
    bool owns(int32_t m) const { return m >= first_moe && m < end_moe; }
    int32_t moe_begin() const { return first_moe; }
    int32_t moe_end()   const { return end_moe; }

    // graph side: the pool tensor of `kind` that mirrors `host` (a layer's expert tensor), or
    // nullptr when this layer/tensor is not split
    ggml_tensor * pool_tensor(int il, const ggml_tensor * host) const;
    // (a pool of every expert computes any ubatch on the device, the device half alone)
    bool split_ubatch(uint32_t n_tokens) const { return holds_all || (int32_t) n_tokens <= max_split_tokens; }
    bool holds_every_expert() const { return holds_all; }

    // fill the residency maps for a ubatch: cpu [n_moe][n_expert] (expert id or -1),
    // dev [n_moe][n_map_positions][n_expert] (slot, or the zero slot of that top-k position);
    // freezes the referenced slots.
    // draft: a pool draft context's ubatch (its own frozen bit; not counted in the stats)
    void fill_maps(int32_t * cpu, int32_t * dev, uint32_t n_tokens, bool draft = false);
    // the context synchronized: unfreeze, count where the last split ubatch computed its experts
    void on_synchronized(const int32_t * routing_ids, int32_t n_tokens);
    // a pool draft context synchronized: unfreeze the slots its ubatches referenced
    void on_draft_synchronized();

    // streamed prefill (spac_engine_params.stream_prefill): a ubatch above the split size runs
    // every expert it may use on the device, the non-resident ones from staging slots (two
    // layers' worth) that the copy worker fills, the next layer's while this one computes
    // (never for a pool of every expert: nothing to stage, its split graph is the device half alone)
    bool streams(uint32_t n_tokens) const {
        return !holds_all && (caches(n_tokens) || (stream_prefill != SPAC_STREAM_OFF && (int32_t) n_tokens > max_split_tokens));
    }
    // the expert-cache ablation (upload_on_miss_tokens) takes this ubatch: misses uploaded into
    // LRU slots at each layer, every routed expert on the device
    bool caches(uint32_t n_tokens) const { return upload_on_miss > 0 && (int32_t) n_tokens <= upload_on_miss; }
    bool stages_used_only(uint32_t n_tokens) const { return stream_prefill == SPAC_STREAM_USED || caches(n_tokens); }
    // the streamed ubatch's maps [n_moe][n_expert]: the pool slot of a resident expert, else its
    // staging slot; freezes the resident slots and asks for the first two layers' copies
    // (a cached ubatch: each layer's gate writes its map and freezes what it maps)
    void fill_stage_maps(int32_t * map, uint32_t n_tokens);
    // graph side, a CPU op before layer m's experts: let layer m+1's copies start once the
    // device is done with layer m-1 (whose staging slots they reuse), then wait for layer m's.
    // SPAC_STREAM_USED: sel (n ids of the layer's router) names the experts to copy, now.
    // A cached ubatch: the misses go to LRU slots and map_out [n_expert] gets layer m's map
    void stage_gate(int32_t m, const int32_t * sel = nullptr, int64_t n = 0, int32_t * map_out = nullptr);
    // spac's miss rule (miss_gate_tokens) takes this split ubatch: each MoE layer's gate decides
    // where its misses compute (never a pool of every expert: it has none)
    bool gates_misses(uint32_t n_tokens) const { return miss_gate_max > 0 && !holds_all && (int32_t) n_tokens <= miss_gate_max; }
    // graph side, a CPU op after layer m's router (sel: its n ids): uploads or streams the misses the
    // rule sends to the device, and writes the layer's maps into out [1 + n_map_positions][n_expert]:
    // the host map (expert, or -1 for one the device computes), then the device maps
    void miss_gate(int32_t m, const int32_t * sel, int64_t n, int32_t * out);
    bool set_miss_costs(const spac_miss_costs * costs, std::string & err);
    struct gate_arg { llama_expert_pool * pool; int32_t m; };
    std::vector<gate_arg> gate_args; // one per MoE layer: the gate op's userdata

    // pool draft: another context on the same model drafts through this pool (throws
    // std::runtime_error when it cannot); detached when either side goes away
    void attach_draft(llama_context * draft);
    void detach_draft(llama_context * draft);

    int32_t set_plan(const uint8_t * utility, const int32_t * threshold,
                     const int32_t * prefetch, int32_t n_prefetch,
                     const int32_t * evict, int32_t n_evict, std::string & err);
    bool wait_idle(int timeout_ms);
    void get_stats(spac_engine_stats & out) const;
    void reset_stats();
    void get_residency(int32_t * slot) const;

    int32_t n_expert = 0;
    int32_t n_expert_used = 0;
    // zero slots per group, one per top-k position on a device: CUDA's MUL_MAT_ID (mmf, mmq)
    // groups a token's rows by expert and expects its ids to be distinct, so the non-resident
    // experts of one token must not all go to one zero slot (1 where absent rows are -1)
    int32_t n_map_positions = 1;
    ggml_backend_t backend = nullptr; // the pool device's backend in the context; nullptr: the CPU's
    ggml_backend_dev_t dev = nullptr;
    int32_t split_graph = SPAC_SPLIT_OVERLAP;
    bool partial_sums = false;        // the halves meet as two partial sums (else per expert)
    int32_t only_half = 0;            // benchmarks: 1 = device half only, 2 = host half only

private:
    enum : uint8_t { FROZEN_TARGET = 1, FROZEN_DRAFT = 2 };
    void unfreeze(uint8_t bit);
    void retry_refused(); // under mtx, after slots thawed
    std::vector<llama_context *> drafts; // attached pool draft contexts

    void worker_loop();
    void apply_plan(std::unique_lock<std::mutex> & lk); // worker: take the pending plan, rebuild the queue
    bool idle() const {
        return plan_applied == plan_seq && queue_pos >= queue.size() && !copying && stage_queue.empty() && !staging;
    }
    // experts e..e+n-1 of layer m (host file layout) -> slots slot..slot+n-1; bytes. Their bytes are
    // consecutive on both sides, so each tensor is one copy. Queued on copy_backend when there is
    // one: done only after finish_copies()
    size_t copy_experts(int32_t m, int32_t e, int32_t n, int32_t slot, uint64_t & n_calls);
    void finish_copies(); // every queued copy has landed
    void fill_every_slot(); // holds_all: every expert copied into its slot at load
    void pin_mapping();   // the mapping's expert range registered as the device's pinned host memory, if it can
    // a batch's copies, (expert, slot) pairs of layer m in ascending experts: a run of consecutive
    // experts into consecutive slots is one copy per tensor; bytes
    size_t copy_runs(int32_t m, const std::vector<int32_t> & keys, const std::vector<int32_t> & slots, uint64_t & n_calls);
    bool wanted(int32_t key) const { return utility[key] >= threshold[key / n_expert]; }
    int32_t pick_slot(group & g, int32_t key); // free slot, else a victim; -1 when none may go
    int32_t lru_slot(group & g, int32_t m, const std::vector<uint8_t> & chosen); // a cached ubatch's miss: free slot, else the LRU one not chosen by layer m; -1
    int32_t take_free_slot(group & g);         // a free slot, taken; -1 when none
    void    evict(group & g, int32_t slot);    // its expert leaves the pool (the slot is then unowned)
    void    begin_stages(std::unique_lock<std::mutex> & lk); // a staged ubatch starts: the stage queue emptied
    int32_t class_lru_slot(group & g, int32_t m, const std::vector<int32_t> & count); // the miss rule's: free, else ClassLRU's victim; -1
    void    count_uses(int32_t m, const std::vector<int32_t> & count); // the ClassLRU's decayed use counts
    // the ClassLRU's clock at MoE layer m: the layers of a ubatch in order within its tokens, as the
    // simulator's LlamaMoeCache
    double  gate_now(int32_t m) const { return token_clock + (double) m / n_moe_layers(); }
    // where expert e of MoE layer m goes when it is staged (two layers' buffers, alternating)
    int32_t staging_slot(const group & g, int32_t m, int32_t e) const { return g.staging + (m % 2) * n_expert + e; }

    llama_context & lctx;
    int32_t first_moe = 0; // the MoE layers [first_moe, end_moe) this pool holds
    int32_t end_moe   = 0;
    ggml_backend_buffer_t buf = nullptr;
    ggml_context * ctx = nullptr;
    int32_t max_split_tokens = 64;
    bool no_evict = false;
    int32_t copy_delay_us = 0;
    int32_t copy_batch = 8;                  // a plan's copies: experts of one layer per batch
    ggml_backend_t copy_backend = nullptr;   // the worker's own backend of the device; nullptr: a CPU pool
    void * pinned_mapping = nullptr;         // the registered start of the mapping's expert range (pin_mapping)
    int32_t stream_prefill = SPAC_STREAM_OFF;
    int32_t upload_on_miss = 0;   // the expert-cache ablation's largest ubatch (0: off)
    bool holds_all = false;       // a slot for every expert: filled at load, no staging slots
    bool caching = false;         // the current streamed ubatch is a cached one
    bool has_staging = false;     // 2 * n_expert staging slots per group (streamed prefill, upload on miss)
    int32_t miss_gate_max = 0;    // spac's miss rule: its largest ubatch (0: off)
    bool miss_costs_set = false;
    spac_miss_costs miss_costs = {};
    // llama.cpp master's ClassLRU (its header comment, release b12170), per key: uses decayed with a
    // 128-token half-life, their class floor(log2), the clock (tokens of gated ubatches) of the last use
    std::vector<float>  use_count;
    std::vector<int8_t> use_class;
    std::vector<double> use_last;
    double token_clock = 0.0;
    uint64_t use_clock = 0;       // the LRU's clock: one tick per touched slot
    std::array<ggml_backend_event_t, 2> stage_events = {}; // device done with a staging buffer (none: a CPU pool)

    std::vector<int> layer_il;    // moe index -> model layer
    std::vector<int> moe_of_il;   // model layer -> moe index or -1
    std::vector<int> layer_group; // moe index -> group
    std::vector<std::array<const ggml_tensor *, LLAMA_EXPERT_N_KINDS>> host; // model tensors
    std::vector<std::array<size_t, LLAMA_EXPERT_N_KINDS>> file_offs;         // their data in the file
    std::vector<std::array<const uint8_t *, LLAMA_EXPERT_N_KINDS>> copy_src; // what copies read (see constructor)
    std::vector<group> groups;

    std::unique_ptr<llama_file> file;
    std::unique_ptr<llama_mmap> mapping;

    // everything below is guarded by mtx; slot_of, utility and threshold are written only by the
    // worker (under mtx), so the worker alone may also read them without it
    mutable std::mutex mtx;
    std::condition_variable cv_work;
    std::condition_variable cv_idle;
    std::vector<int32_t> slot_of;    // key -> published slot or -1
    std::vector<uint8_t> utility;    // plan in effect, key -> utility (only the worker writes it)
    std::vector<int32_t> threshold;  // plan in effect, moe layer -> tau (only the worker writes it)
    // set_plan only stores the plan here and wakes the worker, which builds the queue off the
    // caller's critical path
    struct {
        std::vector<uint8_t> utility;
        std::vector<int32_t> threshold;
        std::vector<int32_t> prefetch; // keys, in the policy's order
        std::vector<int32_t> evict;    // keys
        bool has_prefetch = false;
    } pending;
    uint64_t plan_seq = 0;     // plans received
    uint64_t plan_applied = 0; // plans the worker has taken
    std::vector<int32_t> evict_rank; // key -> position in the explicit evict list, INT32_MAX if none
    std::vector<int32_t> evict_keys; // keys with a rank, to reset them cheaply
    std::vector<int32_t> queue;      // prefetch order of the current plan
    std::vector<int32_t> next_queue; // worker only: built without the lock, then swapped in
    size_t queue_pos = 0;
    bool queue_by_utility = true; // false: an explicit prefetch list in the policy's own order
    bool retry_when_thawed = false; // a request found every slot of its group frozen
    // streamed prefill of the current ubatch: per MoE layer the experts to stage, the layers
    // asked for (in order; the device event to wait for first), how many have landed
    struct stage_request { int32_t m; ggml_backend_event_t event; };
    std::vector<std::vector<int32_t>> stage_keys;
    std::vector<std::vector<int32_t>> stage_slots; // per MoE layer, the slot each of stage_keys' experts goes to
    std::deque<stage_request> stage_queue;
    int32_t stage_done = 0;
    bool staging = false; // the worker is copying a stage request
    std::condition_variable cv_stage;
    bool copying = false;
    bool stop = false;
    std::vector<int32_t> last_dev_map; // maps of the last split ubatch, for the device/CPU counts
    bool last_split_pending = false;
    spac_engine_stats stats = {};

    std::thread worker;
};
