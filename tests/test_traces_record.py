"""Live recording on the tiny model, and parity: the policy object that drove the live engine
makes the same plans when the recorded trace is replayed through the simulator's call path."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.cli.record import record_cmd, record_trace
from orchestrator.runtime.pool import Budget, PoolDevice
from orchestrator.gguf_files.gguf_export import make_random_model, tiny_config
from orchestrator.policies import make_policy, observe
from orchestrator.policies.base import PolicyContext
from orchestrator.policies.plan import StepRouting
from orchestrator.sim.simulator import SimConfig, Simulator

speculative = pytest.importorskip("orchestrator.decoding.speculative")
native = pytest.importorskip("orchestrator.runtime.native")
CFG = tiny_config("qwen3moe", n_layer=2, n_embd=64, n_expert=16, n_expert_used=4, n_ff_exp=64)


def recording(policy):
    """Record every (routing, resident, feedback) → plan call on the instance itself, so that
    the session still sees the policy's own class. The live routing is a view of the engine's
    export buffer: copy it."""
    calls, plan = [], policy.plan

    def wrapped(routing, resident, feedback=None):
        out = plan(routing, resident, feedback)
        kept = None if routing is None else StepRouting(selected=routing.selected.copy(), n_drafted=routing.n_drafted,
                                                        n_accepted=routing.n_accepted)
        calls.append((kept, resident.copy(), feedback, out))
        return out

    policy.plan = wrapped
    return calls


def session_config(tmp_path_factory, name):
    """A random tiny MoE target and its Q4_0 self-draft (same experts), engine on."""
    if not native.engine_built():
        pytest.skip("native engine not built")
    d = tmp_path_factory.mktemp(name)
    target = make_random_model(d / "target.gguf", CFG, seed=1)
    draft = make_random_model(d / "draft-q4_0.gguf", CFG, seed=1, quant="q4_0")
    return d, speculative.SessionConfig(model=target, draft=draft, gamma=4, n_ctx=512, n_threads=1, expert_engine=True,
                                        pool=(PoolDevice("CPU", Budget(ratio=0.25)),), calibration_cache=d / "cal.json")


@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    d, cfg = session_config(tmp_path_factory, "record")
    policy = make_policy("moe-spac-paper")
    calls = recording(policy)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, 12).tolist() for _ in range(3)]
    with speculative.Session(cfg, policy=policy) as session:
        trace = record_trace(session, d / "tiny.npz", prompts, max_tokens=24)
    return trace, policy, calls


def test_recorded_trace_matches_the_live_steps(live_run):
    trace, policy, calls = live_run
    steps = [c for c in calls if c[0] is not None]
    assert trace.n_steps == len(steps) > 10
    assert (trace.n_layer, trace.n_expert, trace.top_k) == (2, 16, 4)
    for i, (routing, *_rest) in enumerate(steps):
        np.testing.assert_array_equal(trace.step(i).selected, routing.selected)
        assert (trace.n_drafted[i], trace.n_accepted[i]) == (routing.n_drafted, routing.n_accepted)


def test_recorded_prompts_go_with_each_prompts_first_step(live_run):
    """Each prompt's pass (12 tokens, nothing cached from the one before) is kept with the first
    step of its decode, every row in every layer but the last, which computed the output row only
    (the export leaves it out, -1)."""
    trace, *_ = live_run
    p = trace.position.astype(np.int64)
    first = np.r_[0, np.flatnonzero(p[1:] < p[:-1]) + 1]
    assert np.flatnonzero(trace.prompt_rows).tolist() == first.tolist()
    assert trace.prompt_rows[first].tolist() == [12, 12, 12]
    prompt = trace.prompt_step(0).selected
    assert (prompt[:, :-1] >= 0).all() and (prompt[:, -1, 0] >= 0).sum() <= 1


def test_recorded_positions_follow_the_accepted_tokens(live_run):
    """Each step's position is the target's cache before its pass: it grows by the tokens the step
    kept, and starts again with every prompt (12 tokens each)."""
    trace, *_ = live_run
    p = trace.position.astype(np.int64)
    grown = p[1:] - p[:-1]
    new_prompt = np.flatnonzero(grown < 0) + 1
    assert len(new_prompt) == 2
    assert set(p[np.r_[0, new_prompt]].tolist()) == {12}
    kept = np.delete(trace.n_accepted[:-1] + 1, new_prompt - 1)
    np.testing.assert_array_equal(np.delete(grown, new_prompt - 1), kept)


def test_replay_makes_the_live_plans(live_run):
    trace, policy, calls = live_run
    replay = make_policy("moe-spac-paper")
    ctx = policy.ctx
    replay.reset(PolicyContext(ctx.n_layer, ctx.n_expert, ctx.top_k, ctx.capacity, ctx.gamma))
    step = 0
    for routing, resident, feedback, live_plan in calls:
        if routing is not None:
            routing = trace.step(step)  # from the file, as the simulator reads it
            observe(replay, routing, trace.n_expert)
            step += 1
        plan = replay.plan(routing, resident, feedback)
        np.testing.assert_array_equal(plan.utility, live_plan.utility)
        np.testing.assert_array_equal(plan.threshold, live_plan.threshold)


def test_simulator_replays_the_recorded_trace(live_run):
    trace, policy, _ = live_run
    sim = Simulator(trace, SimConfig(capacity=policy.ctx.capacity, draft=None))
    for name in ("moe-spac-paper", "static", "lru", "belady", "spac"):
        result = sim.run(make_policy(name))
        assert result.tokens == trace.n_generated and 0.0 <= result.hit_rate <= 1.0


def test_trace_record_command(live_run, tmp_path, monkeypatch):
    import typer
    from typer.testing import CliRunner

    from orchestrator.sim.trace import read_trace

    monkeypatch.setenv("SPAC_CACHE_DIR", str(tmp_path))  # calibration cache
    target = make_random_model(tmp_path / "target.gguf", CFG, seed=1)
    draft = make_random_model(tmp_path / "draft.gguf", CFG, seed=1, quant="q4_0")
    app = typer.Typer()
    trace = typer.Typer()
    trace.command("record")(record_cmd)
    app.add_typer(trace, name="trace")
    out = tmp_path / "cli.npz"
    r = CliRunner().invoke(app, ["trace", "record", str(out), "--prompt", "hello there", "--prompt", "abc",
                                 "-m", str(target), "-md", str(draft), "--draft-max", "4", "-n", "16",
                                 "-t", "1", "-c", "512"])
    assert r.exit_code == 0, r.output
    t = read_trace(out)
    assert t.n_steps > 0 and t.meta["gamma"] == 4 and (t.n_drafted <= 4).all()
    r = CliRunner().invoke(app, ["trace", "record", str(out)])
    assert r.exit_code != 0


@pytest.fixture(scope="module")
def lookahead_run(tmp_path_factory):
    """The default ranking live (host compute on miss: what the native engine does), with the
    Q4_0 self-draft's routing read from the draft context while it drafts."""
    d, cfg = session_config(tmp_path_factory, "lookahead")
    policy = make_policy("spac/host")
    calls = []
    plan, draft_plan = policy.plan, policy.draft_plan

    def on_plan(routing, resident, feedback=None):
        out = plan(routing, resident, feedback)
        kept = None if routing is None else StepRouting(selected=routing.selected.copy(), weights=routing.weights.copy(),
                                                        n_drafted=routing.n_drafted, n_accepted=routing.n_accepted)
        calls.append(("plan", kept, resident.copy(), feedback, out))
        return out

    def on_draft(drafted, resident):
        out = draft_plan(drafted, resident)
        calls.append(("draft", drafted.copy(), resident.copy(), None, out))
        return out

    policy.plan, policy.draft_plan = on_plan, on_draft
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, 12).tolist() for _ in range(2)]
    with speculative.Session(cfg, policy=policy) as session:
        assert session.draft_routing is not None
        trace = record_trace(session, d / "lookahead.npz", prompts, max_tokens=24)
    return trace, policy, calls, d / "lookahead.npz"


def test_draft_routing_is_recorded_and_replays_the_live_plans(lookahead_run):
    trace, policy, calls, _ = lookahead_run
    assert trace.has_draft_routing and trace.n_steps > 5
    drafts = [c for c in calls if c[0] == "draft"]
    assert len(drafts) == int(trace.n_drafted.sum())  # one lookahead plan per draft token
    # replay from the file through the calls the simulator makes: same plans
    replay = make_policy("spac/host")
    ctx = policy.ctx
    replay.reset(PolicyContext(ctx.n_layer, ctx.n_expert, ctx.top_k, ctx.capacity, ctx.gamma))
    step, row = 0, 0
    for kind, routing, resident, feedback, live_plan in calls:
        if kind == "plan":
            if routing is not None:
                routing = trace.step(step)
                step += 1
                row = 0
            plan = replay.plan(routing, resident, feedback)
        else:
            row += 1
            drafted = trace.draft_step(step)[:row]
            np.testing.assert_array_equal(drafted, routing)
            plan = replay.draft_plan(drafted, resident)
        for a, b in ((plan.utility, live_plan.utility), (plan.prefetch, live_plan.prefetch), (plan.evict, live_plan.evict)):
            np.testing.assert_array_equal(a, b)


def test_recorded_trace_simulates_as_its_own_model(lookahead_run):
    from typer.testing import CliRunner

    from orchestrator.cli.main import app

    _, _, _, path = lookahead_run
    r = CliRunner().invoke(app, ["sim", "run", "--trace", str(path), "-p", "spac", "-p", "lru/host"])
    assert r.exit_code == 0, r.output
    assert "lookahead" not in r.output or "skipped" not in r.output
    r = CliRunner().invoke(app, ["sim", "accuracy", "--trace", str(path)])
    assert r.exit_code == 0 and "previous step" in r.output, r.output
