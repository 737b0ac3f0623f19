#pragma once

// The routed experts of a model larger than RAM, read from the disk when used (spac).
//
// Loaded with llama_model_params.lazy_mode = LLAMA_LAZY_MODE_EXPERTS, the routed expert weights
// stay in the file mapping and are never read, locked or copied at load (upstream's lazy tensors).
// Each MoE layer's gate, once its router has chosen, asks for the chosen experts' pages not yet in
// memory all at once (a read of each whole expert, many in flight) before the expert matmuls fault
// them in one page at a time; those experts are the layer's stalls. The orchestrator's host tier
// reads ahead the experts the next pass will likely use and drops the ones it does not keep
// (spac_disk_advise): where an expert is read from changes, never what is computed.

#include "spac.h"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

struct ggml_context;
struct ggml_tensor;
struct llama_model;

struct llama_experts_on_disk {
    explicit llama_experts_on_disk(const llama_model & model);

    // the layer's selected experts [n_expert_used, n_tokens] after a gate that reads those not in
    // memory before anything downstream runs (a CPU op; the ids pass through unchanged)
    ggml_tensor * gate(ggml_context * ctx, ggml_tensor * selected, int il);

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
        llama_experts_on_disk * disk = nullptr;
    };
    std::vector<layer> layers; // by model layer; empty weights: no routed experts there

    mutable std::mutex on_device_mutex; // set by the orchestrator's thread, read by a graph's
    std::vector<uint8_t> on_device;     // [moe layer][expert]; empty: nothing on a device

    std::atomic<uint64_t> n_gate_experts{0}, n_stalls{0}, bytes_stalled{0};
    std::atomic<uint64_t> n_read_ahead{0}, bytes_read_ahead{0}, n_dropped{0};
    std::atomic<uint64_t> gate_advise_ns{0};

    bool valid(int il, int expert) const;
    void gate_layer(const layer & l, const int32_t * ids, int64_t n, int ith, int nth);
};
