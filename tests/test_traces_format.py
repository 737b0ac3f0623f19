"""Routing-trace format: writer/reader round trip and clear errors on bad files."""

from __future__ import annotations

import zipfile
from dataclasses import replace

import numpy as np
import pytest

from orchestrator.policies.plan import StepRouting
from orchestrator.sim.trace import Trace, TraceError, TraceWriter, read_trace

L, E, K = 3, 16, 4


def random_step(rng, n_drafted, n_accepted, weights=True):
    sel = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(n_drafted + 1)])
    w = rng.random(sel.shape).astype(np.float32) if weights else None
    return StepRouting(selected=sel.astype(np.int32), weights=w, n_drafted=n_drafted, n_accepted=n_accepted)


def write_trace(path, steps, draft=None, **kw):
    with TraceWriter(path, n_layer=L, n_expert=E, top_k=K, model="tiny", meta={"gamma": 3}, **kw) as w:
        for i, s in enumerate(steps):
            w.append(s, None if draft is None else draft[i])
    return path


def test_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    steps = [random_step(rng, d, a) for d, a in [(3, 1), (3, 3), (0, 0), (2, 0)]]
    draft = [rng.integers(0, 1, (s.n_drafted, L, K)) + np.arange(K) for s in steps]
    t = read_trace(write_trace(tmp_path / "t.npz", steps, draft))
    assert (t.n_layer, t.n_expert, t.top_k, t.model, t.meta) == (L, E, K, "tiny", {"gamma": 3})
    assert t.n_steps == 4 and t.n_rows == 4 + 4 + 1 + 3 and t.n_generated == 2 + 4 + 1 + 1
    for i, s in enumerate(steps):
        got = t.step(i)
        np.testing.assert_array_equal(got.selected, s.selected)
        np.testing.assert_allclose(got.weights, s.weights, rtol=1e-3)  # stored as float16
        assert (got.n_drafted, got.n_accepted) == (s.n_drafted, s.n_accepted)
        np.testing.assert_array_equal(t.draft_step(i), draft[i])
    np.testing.assert_array_equal(t.layer_index, np.arange(L))
    assert t.head(2).n_steps == 2 and t.head(2).n_rows == 8


def test_without_optional_arrays(tmp_path):
    rng = np.random.default_rng(1)
    t = read_trace(write_trace(tmp_path / "t.npz", [random_step(rng, 2, 1, weights=False)]))
    assert t.weights is None and t.draft_selected is None and t.step(0).weights is None
    assert t.position is None and t.step(0).position is None


def test_positions_round_trip(tmp_path):
    rng = np.random.default_rng(7)
    steps = [replace(random_step(rng, 3, a), position=p) for a, p in [(1, 11), (3, 13), (0, 17)]]
    t = read_trace(write_trace(tmp_path / "t.npz", steps))
    assert [t.step(i).position for i in range(3)] == [11, 13, 17]
    assert t.head(2).position.tolist() == [11, 13]
    w = TraceWriter(tmp_path / "u.npz", n_layer=L, n_expert=E, top_k=K)
    w.append(steps[0])
    with pytest.raises(TraceError, match="position must be given for every step"):
        w.append(replace(steps[1], position=None))
    with pytest.raises(TraceError, match="negative position"):
        w.append(replace(steps[1], position=-1))
    with pytest.raises(TraceError, match="negative position at step 1"):
        read_trace(rewrite(tmp_path / "t.npz", position=np.array([11, -2, 17], dtype=np.int32)))
    with pytest.raises(TraceError, match="one entry per step"):
        read_trace(rewrite(tmp_path / "t.npz", position=np.array([11, 13], dtype=np.int32)))


def test_prompt_passes_round_trip(tmp_path):
    """A prompt pass goes with the step after it; its rows may hold -1 (a row the layer did not
    compute), a step's may not; one with no step after it is left out."""
    rng = np.random.default_rng(5)
    steps = [random_step(rng, d, a) for d, a in [(3, 1), (0, 0), (2, 2)]]
    prompt = random_step(rng, 4, 0).selected
    prompt[:-1, -1] = -1  # the last layer keeps only the output row
    w = TraceWriter(tmp_path / "t.npz", n_layer=L, n_expert=E, top_k=K)
    w.append_prompt(prompt)
    w.append(steps[0])
    w.append(steps[1])
    w.append_prompt(prompt[:2])
    w.append(steps[2])
    w.append_prompt(prompt)  # no step follows
    t = read_trace(w.close())
    assert t.prompt_rows.tolist() == [5, 0, 2] and t.n_rows == 4 + 1 + 3
    np.testing.assert_array_equal(t.prompt_step(0).selected, prompt)
    assert t.prompt_step(0).n_tokens == 5 and t.prompt_step(0).n_accepted == 0
    assert t.prompt_step(1) is None
    np.testing.assert_array_equal(t.prompt_step(2).selected, prompt[:2])
    assert t.head(2).prompt_rows.tolist() == [5, 0] and len(t.head(2).prompt_selected) == 5
    assert read_trace(write_trace(tmp_path / "u.npz", steps)).prompt_rows is None
    with pytest.raises(TraceError, match="out of range"):
        w2 = TraceWriter(tmp_path / "v.npz", n_layer=L, n_expert=E, top_k=K)
        w2.append_prompt(np.full((2, L, K), E))
    with pytest.raises(TraceError, match=r"prompt_selected has 4 rows but the step counts imply 7"):
        read_trace(rewrite(tmp_path / "t.npz", prompt_selected=t.prompt_selected[:4]))
    with pytest.raises(TraceError, match="prompt_rows and prompt_selected go together"):
        Trace(n_layer=L, n_expert=E, top_k=K, n_drafted=t.n_drafted, n_accepted=t.n_accepted,
              selected=t.selected, prompt_rows=t.prompt_rows)


def test_truncated_file(tmp_path):
    rng = np.random.default_rng(2)
    path = write_trace(tmp_path / "t.npz", [random_step(rng, 3, 2) for _ in range(20)])
    data = path.read_bytes()
    for cut in (10, len(data) // 2, len(data) - 30):
        bad = tmp_path / f"cut{cut}.npz"
        bad.write_bytes(data[:cut])
        with pytest.raises(TraceError, match="truncated or corrupt"):
            read_trace(bad)


def test_missing_file_and_foreign_npz(tmp_path):
    with pytest.raises(TraceError, match="no such file"):
        read_trace(tmp_path / "nope.npz")
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(TraceError, match="not a spac routing trace"):
        read_trace(tmp_path / "other.npz")


def rewrite(path, **changes):
    with np.load(path, allow_pickle=False) as z:
        data = {k: z[k] for k in z.files}
    for k, v in changes.items():
        if v is None:
            del data[k]
        else:
            data[k] = v
    np.savez(path, **data)
    return path


@pytest.fixture
def good(tmp_path):
    rng = np.random.default_rng(3)
    return write_trace(tmp_path / "t.npz", [random_step(rng, 3, 1) for _ in range(5)])


@pytest.mark.parametrize("change, message", [
    (dict(selected=None), "missing key"),
    (dict(version=np.array(7)), "version 7"),
    (dict(format=np.array("something")), "format is"),
    (dict(n_drafted=np.array([3, 3, 3, 3, 4], dtype=np.int32)), "truncated or its arrays do not belong"),
    (dict(n_accepted=np.array([1, 1, 4, 1, 1], dtype=np.int32)), "step 2: n_accepted=4"),
    (dict(n_accepted=np.array([1, 1, 1], dtype=np.int32)), "n_accepted has 3"),
    (dict(layer_index=np.arange(2, dtype=np.int32)), "layer_index"),
    (dict(n_expert=np.array(8)), "out of range"),
    (dict(top_k=np.array(3)), "expected \\(rows"),
    (dict(weights=np.zeros((19, L, K), dtype=np.float16)), "weights has shape"),
    (dict(meta_json=np.array("{not json")), "meta_json"),
])
def test_inconsistent_files(good, change, message):
    with pytest.raises(TraceError, match=message):
        read_trace(rewrite(good, **change))


def test_bad_ids_and_weights(good):
    with np.load(good) as z:
        sel, w = z["selected"].copy(), z["weights"].copy()
    sel2 = sel.copy()
    sel2[4, 1, 2] = sel2[4, 1, 0]
    with pytest.raises(TraceError, match="row 4, layer 1"):
        read_trace(rewrite(good, selected=sel2))
    sel3 = sel.copy()
    sel3[0, 0, 0] = -1
    with pytest.raises(TraceError, match="expert id -1"):
        read_trace(rewrite(good, selected=sel3))
    w[2, 2, 2] = np.nan
    with pytest.raises(TraceError, match="NaN"):
        read_trace(rewrite(good, selected=sel, weights=w))


def test_writer_rejects_bad_steps(tmp_path):
    rng = np.random.default_rng(4)
    w = TraceWriter(tmp_path / "t.npz", n_layer=L, n_expert=E, top_k=K)
    s = random_step(rng, 3, 1)
    with pytest.raises(TraceError, match="expected \\(4, 3, 4\\)"):
        w.append(StepRouting(selected=s.selected[:3], n_drafted=3, n_accepted=1))
    with pytest.raises(TraceError, match="n_accepted=5"):
        w.append(StepRouting(selected=s.selected, n_drafted=3, n_accepted=5))
    w.append(s)
    with pytest.raises(TraceError, match="weights must be given for every step"):
        w.append(StepRouting(selected=s.selected, n_drafted=3, n_accepted=1))
    with pytest.raises(TraceError, match="draft routing must be given"):
        w.append(s, draft_selected=np.zeros((3, L, K), dtype=np.int32) + np.arange(K))
    w.close()
    assert read_trace(tmp_path / "t.npz").n_steps == 1
    with pytest.raises(TraceError, match="closed"):
        w.append(s)


def test_writer_rejects_bad_draft_routing(tmp_path):
    rng = np.random.default_rng(6)
    w = TraceWriter(tmp_path / "t.npz", n_layer=L, n_expert=E, top_k=K)
    s = random_step(rng, 3, 1)
    with pytest.raises(TraceError, match="draft_selected has shape"):
        w.append(s, draft_selected=np.zeros((2, L, K), dtype=np.int32) + np.arange(K))
    with pytest.raises(TraceError, match="draft_selected: expert chosen twice"):
        w.append(s, draft_selected=np.zeros((3, L, K), dtype=np.int32))


def test_writer_keeps_steps_when_the_loop_raises(tmp_path):
    rng = np.random.default_rng(5)
    with pytest.raises(RuntimeError):
        with TraceWriter(tmp_path / "t.npz", n_layer=L, n_expert=E, top_k=K) as w:
            w.append(random_step(rng, 2, 2))
            raise RuntimeError("engine died")
    assert read_trace(tmp_path / "t.npz").n_steps == 1


def test_trace_constructor_validates():
    with pytest.raises(TraceError, match="rows"):
        Trace(n_layer=L, n_expert=E, top_k=K, n_drafted=np.array([2]), n_accepted=np.array([0]),
              selected=np.zeros((2, L, K), dtype=np.int16))


def test_rows_a_layer_did_not_compute_count_nowhere():
    """A prompt's last layer keeps only its output rows; the routing export marks the others -1."""
    from orchestrator.policies.plan import StepRouting
    from orchestrator.policies.base import layer_usage

    selected = np.array([[[0, 1], [2, 3]], [[1, 2], [-1, -1]]])  # [n_tokens 2, n_layer 2, top_k 2]
    weights = np.full(selected.shape, 0.5)
    routing = StepRouting(selected=selected, weights=weights)
    assert routing.frequency(4).tolist() == [[1, 2, 1, 0], [0, 0, 1, 1]]
    counts, sums = layer_usage(routing, 4)
    assert counts.tolist() == [[1, 2, 1, 0], [0, 0, 1, 1]] and sums[1].tolist() == [0.0, 0.0, 0.5, 0.5]
