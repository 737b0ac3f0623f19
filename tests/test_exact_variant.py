"""The variants of CPU_EXACT's one-token kernels (groups a thread reads at once, prefetch distance:
`orchestrator/runtime/exact_variant.py`, issue 52) give the same bits, so `--repack auto` may
choose the fastest on the user's CPU without changing any text. Run on the AVX-512 build and, by
scripts/test_avx2.sh, on the AVX2 one."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from orchestrator.runtime import exact_variant, host_layout
from orchestrator.runtime.exact_variant import DEFAULT, Variant
from orchestrator.runtime.llm import Model
from orchestrator.runtime.native import engine_built
from orchestrator.gguf_files.gguf_export import make_random_model, tiny_config

pytestmark = pytest.mark.skipif(not engine_built(), reason="needs the patched llama.cpp")

TYPES = ("f16", "bf16", "q4_0", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs", "mxfp4")


@pytest.fixture(autouse=True)
def batch_invariant():
    host_layout.set_batch_invariant_rows(32)  # the plain layout takes CPU_EXACT's kernels too
    yield
    host_layout.set_batch_invariant_rows(0)
    exact_variant.set_variant(DEFAULT)


@pytest.mark.parametrize("type_name", TYPES)
def test_every_variant_gives_the_default_variants_bits(type_name):
    """Per layout (plain in batch-invariant mode, CPU_EXACT), MUL_MAT and MUL_MAT_ID, one and two
    tokens, one and two threads: every variant's output is the default's, byte for byte. 17 groups
    of 16 distinct rows, so that 8 groups at once leaves a tail and a group read in another's place
    would show."""
    ggml_type = int(GGMLQuantizationType[type_name.upper()])
    rng = np.random.default_rng(3)
    n_in, n_out = 512, 17 * 16
    bufts = host_layout.cpu_buffer_types()
    checked = 0
    for buft_name in ("CPU", host_layout.EXACT_BUFT):
        for n_expert, n_used in ((0, 1), (4, 2)):
            for n_tokens in (1, 2):
                xs = rng.standard_normal((n_tokens, n_used, n_in), dtype=np.float32)
                ids = np.argsort(rng.random((n_tokens, n_expert)), axis=1)[:, :n_used].astype(np.int32) if n_expert else None

                with host_layout.matmul_runner(ggml_type, n_in, n_out, n_expert, xs, ids, bufts[buft_name],
                                               sample_rows=n_out * max(n_expert, 1)) as run:
                    if run is None:
                        continue  # this layout does not take the weight
                    want = run(1)
                    for variant in exact_variant.EVERY:
                        for threads in (1, 2):
                            with exact_variant.using(variant):
                                got = run(threads)
                            assert got.tobytes() == want.tobytes(), \
                                f"{type_name} {buft_name} {'MUL_MAT_ID' if n_expert else 'MUL_MAT'} {n_tokens} tokens: " \
                                f"{variant}, {threads} threads"
                checked += 1
    assert checked >= 4  # the plain layout's four cases at least (F16/BF16 have no CPU_EXACT layout)


def test_a_variant_the_kernels_lack_is_refused_and_changes_nothing():
    exact_variant.set_variant(Variant(2, 1024))
    for bad in (Variant(3, 0), Variant(16, 0), Variant(4, -64), Variant(4, 100), Variant(4, 32768)):
        with pytest.raises(ValueError, match="no variant"):
            exact_variant.set_variant(bad)
        assert exact_variant.current() == Variant(2, 1024)


def test_the_default_stays_unless_another_is_clearly_faster():
    base = {DEFAULT.key: 1.00, "2/2048": 0.99, "8/1024": 1.10}
    assert exact_variant.choose(base) == DEFAULT  # 1% is the timings' noise
    assert exact_variant.choose({**base, "1/4096": 0.90}) == Variant(1, 4096)
    assert exact_variant.choose({"1/0": 2.0, "2/0": 1.0}) == Variant(2, 0)  # the default not timed


def test_measure_tries_the_group_counts_then_the_distances_at_the_best_count(monkeypatch):
    """8 timings: 4 group counts at the default distance, then every distance at the fastest count."""
    tried = []
    speed = {1: 3.0, 2: 1.0, 4: 2.0, 8: 4.0}

    def fake(timer, ggml_type, shapes, n_threads, buft, candidates):
        tried.append(list(candidates))
        return {v.key: speed[v.groups] - v.prefetch / 1e4 for v in candidates}

    monkeypatch.setattr(exact_variant, "time_variants", fake)
    ms = exact_variant.measure(None, {2: [(512, 256, 4, 2)]}, 2, 0)
    assert tried == [[Variant(g, DEFAULT.prefetch) for g in exact_variant.GROUPS],
                     [Variant(2, p) for p in exact_variant.PREFETCH]]
    assert exact_variant.choose(ms) == Variant(2, 4096)


def test_auto_times_the_variants_once_and_the_load_sets_the_choice(tmp_path, monkeypatch):
    """--repack auto with experts in CPU_EXACT: the variants are timed on the model's expert shapes
    (a few seconds), the report says which was chosen, the load sets it, and a second load reads
    the cache instead of timing again."""
    monkeypatch.setenv("SPAC_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    make_random_model(path, tiny_config("qwen3moe", n_layer=1, n_embd=256, n_expert=8, n_expert_used=2,
                                        n_ff_exp=256), quant="q4_0")
    exact_variant.set_variant(Variant(1, 0))
    model = Model(path, repack="auto", exact=True)
    try:
        layout = model.layout
        assert layout.types["Q4_0"].buft == host_layout.EXACT_BUFT
        assert layout.kernel_variant is not None and len(layout.variant_ms) == 7  # 8 timings, one variant twice
        assert exact_variant.current() == Variant.of_key(layout.kernel_variant)
        assert "CPU_EXACT one-token kernels: " in layout.report()
    finally:
        model.close()

    def no_timing(*args, **kwargs):
        raise AssertionError("timed again")

    monkeypatch.setattr(exact_variant, "time_variants", no_timing)
    again = Model(path, repack="auto", exact=True)
    try:
        assert again.layout.kernel_variant == layout.kernel_variant
    finally:
        again.close()


def test_no_variant_is_chosen_off_auto_or_off_exact_mode(tmp_path, monkeypatch):
    monkeypatch.setenv("SPAC_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    make_random_model(path, tiny_config("qwen3moe", n_layer=1, n_embd=256, n_expert=8, n_expert_used=2,
                                        n_ff_exp=256), quant="q4_0")
    for repack, exact in (("on", True), ("off", True), ("auto", False)):
        assert host_layout.choose(path, 1, repack, exact=exact).kernel_variant is None
