// MUL_MAT_ID with expert id -1 on the CPU backend (ggml-patches/0001).
//
//   test_mmid_skip TYPE N_THREADS REPACK SEED      TYPE: f32 | q8_0 | q4_0 | q4_k
//
// Runs mul_mat_id twice on the same weights and inputs:
//   skip: ids with random -1s;
//   ref:  the same ids with the -1 of slot s pointed at an extra expert N_EXPERT + s appended
//         to the weights (one per slot, so a token still picks distinct experts).
// Every real expert then sees exactly the same rows in the same order in both runs (same
// row groups, same per-expert kernel choice), so the rows of real experts must be
// byte-identical, and the -1 rows of the skip run must be exactly zero.
// REPACK=1 puts the weights in the CPU_REPACK buffer type (Q4_0/Q4_K/Q8_0 are repacked on
// AVX2 machines); the program prints whether they were. Exit code 0 = pass.

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { K = 256, R = 64, N_EXPERT = 8, N_USED = 4, N_TOKENS = 40 };

static uint64_t rng_state;

static uint32_t rng(void) {
    // xorshift64*: deterministic across platforms, unlike rand()
    rng_state ^= rng_state >> 12; rng_state ^= rng_state << 25; rng_state ^= rng_state >> 27;
    return (uint32_t) ((rng_state * 2685821657736338717ULL) >> 32);
}

static float rng_f32(void) { return (float) rng() / 4294967296.0f * 2.0f - 1.0f; }

static ggml_backend_buffer_type_t repack_buft(void) {
    ggml_backend_dev_t cpu_dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(cpu_dev);
    ggml_backend_dev_get_extra_bufts_t get_extra = (ggml_backend_dev_get_extra_bufts_t)
        ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    ggml_backend_buffer_type_t * bufts = get_extra ? get_extra(cpu_dev) : NULL;
    for (; bufts && *bufts; bufts++) {
        if (strcmp(ggml_backend_buft_name(*bufts), "CPU_REPACK") == 0) {
            return *bufts;
        }
    }
    return NULL;
}

// one mul_mat_id run; weights: n_expert experts of R x K floats, quantized to `type`
static void run(ggml_backend_t backend, enum ggml_type type, int use_repack, int n_expert,
                const float * weights, const float * x, const int32_t * ids, float * out, int * repacked) {
    struct ggml_init_params ip = { 8*ggml_tensor_overhead() + ggml_graph_overhead(), NULL, true };
    struct ggml_context * wctx = ggml_init(ip);
    struct ggml_context * ctx  = ggml_init(ip);

    struct ggml_tensor * as  = ggml_new_tensor_3d(wctx, type, K, R, n_expert);
    struct ggml_tensor * b   = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, K, 1, N_TOKENS);
    struct ggml_tensor * idt = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, N_USED, N_TOKENS);
    struct ggml_tensor * dst = ggml_mul_mat_id(ctx, as, b, idt);
    struct ggml_cgraph * gf  = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, dst);

    ggml_backend_buffer_type_t wbuft = use_repack ? repack_buft() : ggml_backend_get_default_buffer_type(backend);
    ggml_backend_buffer_t wbuf = ggml_backend_alloc_ctx_tensors_from_buft(wctx, wbuft);
    ggml_backend_buffer_t buf  = ggml_backend_alloc_ctx_tensors(ctx, backend);
    ggml_backend_buffer_set_usage(wbuf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);

    const int64_t n = (int64_t) K * R * n_expert;
    if (type == GGML_TYPE_F32) {
        ggml_backend_tensor_set(as, weights, 0, ggml_nbytes(as));
    } else {
        void * q = malloc(ggml_nbytes(as));
        ggml_quantize_chunk(type, weights, q, 0, (int64_t) R * n_expert, K, NULL);
        ggml_backend_tensor_set(as, q, 0, ggml_nbytes(as));
        free(q);
    }
    (void) n;
    *repacked = as->extra != NULL;

    ggml_backend_tensor_set(b, x, 0, ggml_nbytes(b));
    ggml_backend_tensor_set(idt, ids, 0, ggml_nbytes(idt));
    if (ggml_backend_graph_compute(backend, gf) != GGML_STATUS_SUCCESS) {
        fprintf(stderr, "graph compute failed\n");
        exit(2);
    }
    ggml_backend_tensor_get(dst, out, 0, ggml_nbytes(dst));

    ggml_backend_buffer_free(buf);
    ggml_backend_buffer_free(wbuf);
    ggml_free(ctx);
    ggml_free(wctx);
}

int main(int argc, char ** argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s f32|q8_0|q4_0|q4_k N_THREADS REPACK SEED\n", argv[0]);
        return 2;
    }
    enum ggml_type type;
    if      (strcmp(argv[1], "f32")  == 0) type = GGML_TYPE_F32;
    else if (strcmp(argv[1], "q8_0") == 0) type = GGML_TYPE_Q8_0;
    else if (strcmp(argv[1], "q4_0") == 0) type = GGML_TYPE_Q4_0;
    else if (strcmp(argv[1], "q4_k") == 0) type = GGML_TYPE_Q4_K;
    else { fprintf(stderr, "unknown type %s\n", argv[1]); return 2; }
    const int n_threads  = atoi(argv[2]);
    const int use_repack = atoi(argv[3]);
    rng_state = strtoull(argv[4], NULL, 10) * 0x9E3779B97F4A7C15ULL + 1;

    ggml_backend_t backend = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(backend, n_threads);
    if (use_repack && repack_buft() == NULL) {
        fprintf(stderr, "no CPU_REPACK buffer type\n");
        return 2;
    }

    // weights of N_EXPERT real experts plus N_USED extra experts that the reference run uses for -1
    float * weights = malloc(sizeof(float) * K * R * (N_EXPERT + N_USED));
    for (int64_t i = 0; i < (int64_t) K * R * (N_EXPERT + N_USED); i++) weights[i] = rng_f32();
    float * x = malloc(sizeof(float) * K * N_TOKENS);
    for (int64_t i = 0; i < (int64_t) K * N_TOKENS; i++) x[i] = rng_f32();

    // token 0: all -1; token 1: no -1; the rest: each slot -1 with probability 1/3
    int32_t ids_skip[N_USED * N_TOKENS], ids_ref[N_USED * N_TOKENS];
    // like top-k routing, a token picks N_USED distinct experts (the repack kernel relies on it)
    for (int t = 0; t < N_TOKENS; t++) {
        int32_t perm[N_EXPERT];
        for (int e = 0; e < N_EXPERT; e++) perm[e] = e;
        for (int e = N_EXPERT - 1; e > 0; e--) {
            int j = (int) (rng() % (uint32_t) (e + 1));
            int32_t tmp = perm[e]; perm[e] = perm[j]; perm[j] = tmp;
        }
        for (int s = 0; s < N_USED; s++) {
            int32_t id = perm[s];
            int skip = t == 0 || (t > 1 && rng() % 3 == 0);
            ids_skip[t * N_USED + s] = skip ? -1 : id;
            ids_ref [t * N_USED + s] = skip ? N_EXPERT + s : id;
        }
    }

    const size_t n_out = (size_t) R * N_USED * N_TOKENS;
    float * out_skip = malloc(sizeof(float) * n_out);
    float * out_ref  = malloc(sizeof(float) * n_out);
    for (size_t i = 0; i < n_out; i++) out_skip[i] = 1234.5f;  // stale data must be overwritten
    int repacked_skip = 0, repacked_ref = 0;
    run(backend, type, use_repack, N_EXPERT,     weights, x, ids_skip, out_skip, &repacked_skip);
    run(backend, type, use_repack, N_EXPERT + N_USED, weights, x, ids_ref, out_ref, &repacked_ref);

    int n_bad_zero = 0, n_bad_same = 0, n_skipped = 0;
    for (int t = 0; t < N_TOKENS; t++) {
        for (int s = 0; s < N_USED; s++) {
            const float * a = out_skip + ((size_t) t * N_USED + s) * R;
            const float * r = out_ref  + ((size_t) t * N_USED + s) * R;
            if (ids_skip[t * N_USED + s] < 0) {
                n_skipped++;
                for (int i = 0; i < R; i++) {
                    uint32_t bits; memcpy(&bits, &a[i], 4);
                    n_bad_zero += bits != 0;
                }
            } else {
                n_bad_same += memcmp(a, r, sizeof(float) * R) != 0;
            }
        }
    }

    // all ids -1: the whole output is zero
    int32_t ids_none[N_USED * N_TOKENS];
    for (int i = 0; i < N_USED * N_TOKENS; i++) ids_none[i] = -1;
    int repacked_none = 0;
    for (size_t i = 0; i < n_out; i++) out_skip[i] = 1234.5f;
    run(backend, type, use_repack, N_EXPERT, weights, x, ids_none, out_skip, &repacked_none);
    int n_bad_none = 0;
    for (size_t i = 0; i < n_out; i++) n_bad_none += out_skip[i] != 0.0f;

    printf("type=%s threads=%d repack=%d repacked=%d skipped_rows=%d bad_zero=%d bad_same=%d bad_all_skipped=%d\n",
           ggml_type_name(type), n_threads, use_repack, repacked_skip && repacked_ref,
           n_skipped, n_bad_zero, n_bad_same, n_bad_none);

    free(weights); free(x); free(out_skip); free(out_ref);
    ggml_backend_free(backend);
    return (n_bad_zero || n_bad_same || n_bad_none) ? 1 : 0;
}
