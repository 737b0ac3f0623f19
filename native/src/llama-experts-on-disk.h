#pragma once

// The routed experts of a model larger than RAM, read from the disk when used (spac).
//
// Loaded with llama_model_params.lazy_mode = LLAMA_LAZY_MODE_EXPERTS, the routed expert weights
// stay in the file mapping and are never read, locked or copied at load (upstream's lazy tensors).
// Each MoE layer's gate, once its router has chosen, asks for the chosen experts' pages not yet in
// memory all at once (a read of each whole expert, many in flight) before the expert matmuls fault
// them in one page at a time; those experts are the layer's stalls. The orchestrator's host tier
// reads ahead the experts the next pass will likely use and drops the ones it does not keep
// (spac_disk_advise): where an expert is read from changes, never what is computed. With a read of
// the next layer on (set_read_next), each gate also asks for the next MoE layer's likely experts,
// that layer's router applied to this layer's input, so that the disk reads them while this layer
// computes.

#include "spac.h"

#include <atomic>
#include <condition_variable>
#include <deque>
#include <unordered_map>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

struct ggml_context;
struct ggml_tensor;
struct llama_model;

struct llama_experts_on_disk {
    explicit llama_experts_on_disk(const llama_model & model);
    ~llama_experts_on_disk();

    // the layer's selected experts [n_expert_used, n_tokens] after a gate that reads those not in
    // memory before anything downstream runs (a CPU op; the ids pass through unchanged). cur: the
    // layer's MoE input [n_embd, n_tokens], which the next MoE layer's router (a host weight) turns
    // into the logits the read of the next layer ranks by
    ggml_tensor * gate(ggml_context * ctx, ggml_tensor * selected, ggml_tensor * cur, int il);

    // the next layer's experts each gate asks for: the n best of its router's logits per token on
    // this layer's input, those not in memory (0: none, the default)
    void set_read_next(int n) { read_next = n > 0 ? n : 0; }

    // per (layer, expert): SPAC_DISK_READ or SPAC_DISK_DROP; false for a pair out of range
    bool advise(int il, int expert, int advice);
    // bytes of the expert not in memory now (0: all of it is), -1 for a pair out of range
    int64_t missing_bytes(int il, int expert) const;

    // the experts a device pool holds ([moe layer][expert], 1: held; nullptr: none): the gates do
    // not read them, the device computes them
    void set_on_device(const uint8_t * on_device);

    void get_stats(spac_disk_stats & out) const;
    void reset_stats();

    int32_t n_expert = 0;
    std::vector<int> moe_layers; // the model layers with routed experts, in order (the routing export's)

private:
    // one expert's byte range in the mapping, per weight matrix (up, gate, down or gate_up)
    struct layer {
        std::vector<const ggml_tensor *> weights;
        int il = -1;
        int moe = -1; // its index among the MoE layers
        const layer * next = nullptr;          // the next MoE layer, if any
        const ggml_tensor * router = nullptr;  // its router weight [n_embd, n_expert]
        llama_experts_on_disk * disk = nullptr;
    };
    std::vector<layer> layers; // by model layer; empty weights: no routed experts there

    mutable std::mutex on_device_mutex; // set by the orchestrator's thread, read by a graph's
    std::vector<uint8_t> on_device;     // [moe layer][expert]; empty: nothing on a device

    std::atomic<uint64_t> n_gate_experts{0}, n_stalls{0}, bytes_stalled{0};
    std::atomic<uint64_t> n_read_ahead{0}, bytes_read_ahead{0}, n_dropped{0};
    std::atomic<uint64_t> gate_advise_ns{0};
    std::atomic<uint64_t> n_read_next{0}, bytes_read_next{0}, read_next_ns{0};
    std::atomic<int> read_next{0};

    // the read of the next layer runs on a thread of its own, off the graph's: the gate hands it the
    // next layer's guesses (replacing any not yet asked for: an earlier layer's are stale)
    std::thread reader;
    std::mutex reader_mutex;
    std::condition_variable reader_wake;
    std::vector<std::pair<int, int32_t>> reader_queue; // (model layer, expert), in rank order
    bool reader_stop = false;
    void reader_loop();

    bool valid(int il, int expert) const;
    void gate_layer(const layer & l, const int32_t * ids, int64_t n, const ggml_tensor * logits, int ith, int nth);
    std::vector<std::pair<int, int32_t>> rank_next_layer(const layer & l, const ggml_tensor * logits);
    void direct_guess_locked(const std::vector<std::pair<int, int32_t>> & guesses);
    void read_next_layer(const layer & l, const ggml_tensor * logits, int ith, int nth);
    // the gate's op: ids pass through, logits (or nullptr) rank the next layer's experts
    static void run_gate(ggml_tensor * dst, const ggml_tensor * ids, const ggml_tensor * logits, int ith, int nth, void * ud);

    // EXPERIMENT (SPAC_DISK_DIRECT=N): the experts' ranges are anonymous memory of this process,
    // filled with O_DIRECT reads by io threads, at most N experts resident (LRU beyond)
    struct chunk { uint64_t off; uint8_t * dst; size_t len; int il; int e; int w; };
    static constexpr int MAX_W = 4;              // expert weights per layer at most
    std::vector<std::vector<int32_t>> dwpending; // [il][e * MAX_W + w]: chunks in flight per weight
    std::unordered_map<const ggml_tensor *, std::pair<int, int>> weight_of; // expert weight -> (il, w)
    bool pipe = false;                           // SPAC_DISK_PIPE: the matmuls wait per expert, not the gate
    static void expert_wait(const ggml_tensor * w, int64_t expert, void * ud);
    int direct_max = 0;
    int direct_fd = -1;
    uintptr_t direct_base = 0;
    std::vector<std::thread> io;
    std::mutex dmu;
    std::condition_variable cv_io, cv_done;
    std::deque<chunk> queue;
    bool io_stop = false;
    std::vector<std::vector<int8_t>> dstate;   // [il][e]: 0 absent, 1 in flight, 2 resident
    std::vector<std::vector<int32_t>> dpending; // [il][e]: chunks in flight
    std::vector<std::vector<uint64_t>> dlast;   // [il][e]: last gate use
    uint64_t dclock = 0;
    int dresident = 0;
    bool direct_init();
    void direct_read_locked(int il, const std::vector<int> & experts, bool first); // enqueue (first: ahead of the queue); state -> in flight
    void direct_make_room_locked();            // drop the least recently used until under direct_max
    uint64_t n_wait_in_flight = 0;             // gate experts already in flight (a guess or read ahead)
    void direct_drop_locked(int il, int e);    // free the inner pages; state -> absent
    void io_loop();
    size_t expert_bytes(int il) const;
};
