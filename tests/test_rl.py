"""RL post-training end to end on a tiny model: verifiable tasks, trainer log-probs against the
rollouts', rollouts independent of the actor count (real Ray actors), the loop's U-RB order,
hints that follow their formula and are never trained on, and exact resume."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import numpy as np
import pytest
import torch

from tokenloom.contract import SPECIAL_BLOCK, SPECIAL_TOKENS
from tokenloom.model import ModelConfig
from tokenloom.model.config import MoEConfig
from tokenloom.model.generate import TokenSpace
from tokenloom.model.unified import UnifiedModel
from tokenloom.tokenizers.text import TextTokenizer, TextTokenizerConfig, train_text_tokenizer
from tokenloom.trainer.rl.config import RLConfig
from tokenloom.trainer.rl.hints import hint_fraction, hint_tokens
from tokenloom.trainer.rl.loop import TextCodec, run_rl
from tokenloom.trainer.rl.policy import response_batch, token_logprobs
from tokenloom.trainer.rl.rollout import RolloutPool, RolloutRequest, RolloutWorker
from tokenloom.trainer.rl.tasks import TASKS, TaskItem, get_task, parse_buckets, sft_records

TIMING = ("rollout_seconds", "train_seconds", "rollout_busy")


# -- tasks ------------------------------------------------------------------------------------
def test_rewards_are_exact_well_formed_or_wrong():
    sort, add, countdown = TASKS["sort"], TASKS["add"], TASKS["countdown"]
    item = TaskItem("sort 3 1 2 =", " 1 2 3", 0)
    assert [sort.reward(item, r) for r in (" 1 2 3", " 3 2 1", " 1 2", "123", "")] == [1.0, 0.1, 0.0, 0.0, 0.0]
    item = TaskItem("add 47+385 =", " 432", 2)
    assert [add.reward(item, r) for r in (" 432", " 431", "432", " 4 32")] == [1.0, 0.1, 0.0, 0.0]
    item = TaskItem("countdown 3 5 7 to 22 =", " 3*5+7", 1)
    # any valid expression earns the reward, not only the reference; reusing or dropping a number does not
    assert [countdown.reward(item, r) for r in (" 3*5+7", " 7+5*3", " 5*3+7", " 3*5+5", " 3*5", " (3*5)+7")] == \
        [1.0, 1.0, 1.0, 0.1, 0.1, 0.0]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_references_earn_the_full_reward_and_items_are_seeded(name):
    task = get_task(name)
    buckets = parse_buckets(task, "")
    items = [task.item(7, i, buckets) for i in range(60)]
    assert all(task.reward(it, it.answer) == 1.0 for it in items)
    assert [it.bucket for it in items[: len(buckets)]] == list(buckets)
    assert items == [task.item(7, i, buckets) for i in range(60)]  # a function of (seed, index)
    assert items != [task.item(7, i, buckets, "eval") for i in range(60)]
    with pytest.raises(ValueError, match="buckets"):
        parse_buckets(task, "0,9")


def test_prompt_and_answer_tokenize_as_the_whole_line(tmp_path):
    """The answer starts with a space, so the BPE cuts the record where prompt and answer meet: the
    ids RL conditions on and scores are those the SFT model was trained on."""
    task = get_task("countdown")
    records = sft_records(task, 400, parse_buckets(task, ""))
    info = train_text_tokenizer((r["text"] for r in records), tmp_path, TextTokenizerConfig(vocab_size=300))
    tok = TextTokenizer.load(info.path)
    for i in range(50):
        it = task.item(0, i, (0, 1, 2))
        assert tok.encode(it.prompt) + tok.encode(it.answer) == tok.encode(it.prompt + it.answer)
        assert tok.decode(tok.encode(it.answer)) == it.answer


# -- a tiny policy: a BPE on the task's records and a model taught the easy buckets ------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    task = get_task("sort")
    records = sft_records(task, 2000, (0, 1))
    info = train_text_tokenizer((r["text"] for r in records), tmp_path_factory.mktemp("bpe"),
                                TextTokenizerConfig(vocab_size=280))
    tok = TextTokenizer.load(info.path)
    offset = SPECIAL_BLOCK
    space = TokenSpace((offset, offset + tok.vocab_size), (offset + tok.vocab_size,) * 2, (),
                       {name: i for i, name in enumerate(SPECIAL_TOKENS)})
    codec = TextCodec(lambda s: [i + offset for i in tok.encode(s)],
                      lambda ids: tok.decode([i - offset for i in ids if i >= offset]))
    cfg = ModelConfig(vocab_size=offset + tok.vocab_size, dim=48, n_layers=2, n_heads=2, max_seq_len=64,
                      moe=MoEConfig(n_experts=4, top_k=1, expert_hidden=48))
    torch.manual_seed(0)
    model = UnifiedModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    bos, eos, pad = (space.specials[k] for k in ("<bos>", "<eos>", "<pad>"))
    items = [task.item(1, i, (0, 1), "sft") for i in range(2000)]
    for step in range(120):  # teacher forcing on the answers: the SFT start, partly trained on purpose
        batch = items[(step * 32) % 2000:(step * 32) % 2000 + 32]
        rb = response_batch([[bos, *codec.encode(it.prompt)] for it in batch],
                            [[*codec.encode(it.answer), eos] for it in batch],
                            [[0.0] * (len(codec.encode(it.answer)) + 1) for it in batch],
                            [[0] * (len(codec.encode(it.answer)) + 1) for it in batch], pad)
        logp, _, aux = token_logprobs(model, rb, torch.device("cpu"))
        loss = -(logp * rb.mask).sum() / rb.mask.sum() + aux
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"cfg": cfg, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "space": space,
            "codec": codec, "task": task}


def _rl_cfg(grpo: bool = False, **kw) -> RLConfig:
    base = dict(task="sort", buckets="0,1,2", batch_queries=2, group_size=4, oversample=2, round_tokens=3,
                max_response_tokens=10, steps=4, updates_per_batch=2, lr=3e-4, rollout_actors=0, eval_every=0,
                eval_queries=2, checkpoint_every=0, misc={"clip_low": 0.2, "clip_high": 0.28})
    misc = base.pop("misc")
    base.update(kw)
    cfg = RLConfig(**{k: v for k, v in base.items() if k != "misc"})
    cfg.misc.clip_low, cfg.misc.clip_high = misc["clip_low"], misc["clip_high"]
    if grpo:  # the GRPO-style baseline: a ratio per token, no IcePop gates
        cfg.misc.ratio, cfg.misc.token_gate, cfg.misc.sequence_gate = "token", False, False
    return cfg


def _records(run_dir) -> list[dict]:
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        out.append({k: v for k, v in r.items() if k not in TIMING})
    return out


def _same_records(a: list[dict], b: list[dict], tol: float) -> None:
    """Equal records: every token, query, count and staleness the same, floats within `tol`."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            if isinstance(x[k], float):
                assert math.isclose(x[k], y[k], rel_tol=tol, abs_tol=tol), (k, x[k], y[k])
            else:
                assert x[k] == y[k], k


def test_trainer_logprobs_equal_the_rollouts_and_bf16_weights_make_a_real_mismatch(tiny):
    """With the trainer's numerics the rollout's per-token log-probs are the trainer's (KV cache vs a
    full forward); with bfloat16-rounded weights they differ a little on average (a routing flip
    can move one token more), which is what IcePop gates."""
    model = UnifiedModel(tiny["cfg"])
    model.load_state_dict(tiny["state"])
    model.eval()
    space, codec, task = tiny["space"], tiny["codec"], tiny["task"]
    contexts = [[space.specials["<bos>"], *codec.encode(task.item(0, i, (1, 2)).prompt)] for i in range(6)]
    gaps = {}
    for weights in ("fp32", "bf16"):
        worker = RolloutWorker(asdict(tiny["cfg"]), space, weights, threads=0)
        worker.set_weights(tiny["state"], 0)
        out = worker.generate([RolloutRequest((i, 0), c, 10) for i, c in enumerate(contexts)], 1.0, 3)["results"]
        rb = response_batch(contexts, [out[(i, 0)][0] for i in range(6)], [out[(i, 0)][1] for i in range(6)],
                            [[0] * len(out[(i, 0)][0]) for i in range(6)], space.specials["<pad>"])
        with torch.no_grad():
            logp, _, _ = token_logprobs(model, rb, torch.device("cpu"))
        gap = (logp - rb.logp_infer)[rb.mask].abs()
        gaps[weights] = (float(gap.max()), float(gap.mean()))
    assert gaps["fp32"][0] < 1e-4
    # bf16 rounding moves log-probs by a real amount, mostly a little; one token moved by 1.05 nats
    # on the CI machine (its fixture trains to other weights; a top-1 expert choice near a tie flips
    # discontinuously), so "a little" is said of the mean
    assert gaps["bf16"][0] > 1e-4
    assert gaps["bf16"][1] < 0.1, gaps


def test_rollouts_do_not_depend_on_the_number_of_ray_actors(tiny):
    from tokenloom.platform.config import IngestConfig
    from tokenloom.platform.ingest import ensure_ray

    ensure_ray(IngestConfig())
    space, codec, task = tiny["space"], tiny["codec"], tiny["task"]
    reqs = [RolloutRequest((q, m), [space.specials["<bos>"], *codec.encode(task.item(0, q, (1, 2)).prompt)], 4)
            for q in range(5) for m in range(3)]
    got = {}
    for actors in (0, 2):
        pool = RolloutPool(asdict(tiny["cfg"]), space, actors, "bf16")
        pool.set_weights(tiny["state"], 3)
        got[actors], busy = pool.generate(reqs, 1.0, 11)
        assert len(busy) == max(1, actors) and all(b > 0 for b in busy)
        if actors:  # an actor killed between rounds: Ray restarts it, the pool re-sends the weights
            import ray

            ray.kill(pool.workers[1], no_restart=False)
            again, _ = pool.generate(reqs, 1.0, 11)
            assert pool.retries >= 1 and again.keys() == got[actors].keys()
            assert all(again[k][0] == got[actors][k][0] for k in again)
        pool.close()
    assert got[0].keys() == got[2].keys()
    for key, (ids, logprobs, finished) in got[0].items():  # the same tokens; log-probs up to thread-count rounding
        assert got[2][key][0] == ids and got[2][key][2] == finished
        assert np.allclose(got[2][key][1], logprobs, atol=1e-5)
    assert len({tuple(got[0][(0, m)][0]) for m in range(3)}) > 1  # a group's members sample independently


# -- the loop ------------------------------------------------------------------------------------
def test_urb_loop_trains_queries_in_order_and_resume_is_exact(tiny, tmp_path):
    cfg = _rl_cfg(checkpoint_every=2, eval_every=2)
    whole = run_rl(tiny["cfg"], tiny["state"], tiny["space"], tiny["codec"], cfg, tmp_path / "whole", progress=False)
    records = [r for r in _records(tmp_path / "whole") if "reward" in r]
    assert [r["queries"] for r in records] == [[2 * k, 2 * k + 1] for k in range(4)]  # U-RB: arrival order
    assert any(int(lag) > 0 for r in records for lag in r["staleness"])  # responses spanned policy versions
    assert max(r["rounds"] for r in records) > 1 or any(r["rounds"] == 0 for r in records)
    assert any(r["grad_norm"] > 0 for r in records)  # the groups' rewards differed: the policy moved
    assert (tmp_path / "whole" / "rl.png").is_file()

    cut = run_rl(tiny["cfg"], tiny["state"], tiny["space"], tiny["codec"], _rl_cfg(checkpoint_every=2, eval_every=2, stop_after=2),
                 tmp_path / "cut", progress=False)
    assert cut.steps == 2
    resumed = run_rl(tiny["cfg"], tiny["state"], tiny["space"], tiny["codec"], _rl_cfg(checkpoint_every=2, eval_every=2),
                     tmp_path / "cut", resume_from=tmp_path / "cut", progress=False)
    assert resumed.steps == 2
    assert len([r for r in _records(tmp_path / "cut") if "reward" in r]) == 4
    _same_records(_records(tmp_path / "whole"), _records(tmp_path / "cut"), 1e-6)
    from safetensors.torch import load_file

    wa, wb = load_file(f"{whole.model_dir}/model.safetensors"), load_file(f"{resumed.model_dir}/model.safetensors")
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)
    with pytest.raises(ValueError, match="other RL settings"):
        run_rl(tiny["cfg"], tiny["state"], tiny["space"], tiny["codec"], _rl_cfg(group_size=2), tmp_path / "cut",
               resume_from=tmp_path / "cut", progress=False)


def test_wall_clock_budget_ends_the_run_at_a_step_and_resume_continues(tiny, tmp_path):
    # rl.max_minutes: the step that finishes past the budget ends the invocation like stop_after does
    # (checkpoint, evaluation, model); the budget is a schedule setting, so the resume may lift it
    # the GRPO-style per-token objective runs through the same loop
    grpo = {"grpo": True}
    cut = run_rl(tiny["cfg"], tiny["state"], tiny["space"], tiny["codec"], _rl_cfg(max_minutes=1e-6, **grpo),
                 tmp_path / "run", progress=False)
    assert cut.steps == 1 and cut.checkpoint.endswith("step-000001")
    evals = [r["step"] for r in _records(tmp_path / "run") if r.get("eval") == "pass@1"]
    assert evals == [0, 1]
    resumed = run_rl(tiny["cfg"], tiny["state"], tiny["space"], tiny["codec"], _rl_cfg(steps=3, **grpo),
                     tmp_path / "run", resume_from=tmp_path / "run", progress=False)
    assert resumed.steps == 2
    records = [r for r in _records(tmp_path / "run") if "reward" in r]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert [r["queries"] for r in records] == [[2 * k, 2 * k + 1] for k in range(3)]


def test_ray_actor_rollouts_train_as_the_in_process_ones(tiny, tmp_path):
    from tokenloom.platform.config import IngestConfig
    from tokenloom.platform.ingest import ensure_ray

    ensure_ray(IngestConfig())
    local = run_rl(tiny["cfg"], tiny["state"], tiny["space"], tiny["codec"], _rl_cfg(steps=2), tmp_path / "local",
                   progress=False)
    actors = run_rl(tiny["cfg"], tiny["state"], tiny["space"], tiny["codec"], _rl_cfg(steps=2, rollout_actors=2),
                    tmp_path / "actors", progress=False)
    _same_records(_records(tmp_path / "local"), _records(tmp_path / "actors"), 1e-4)
    lines = (tmp_path / "actors" / "metrics.jsonl").read_text().splitlines()
    busy = [r["rollout_busy"] for r in map(json.loads, lines) if r.get("rollout_busy") is not None]
    assert all(0 <= b <= 1 for b in busy) and any(b > 0 for b in busy)
    assert local.pass_at_1 == actors.pass_at_1


def test_hints_follow_the_schedule_and_are_never_trained_on(tiny, tmp_path):
    """AHRL: pass_init per bucket from k samples of the start; each query of a hard bucket gets the
    prefix of its reference the formula gives at the step it was admitted (oversample 1: the step
    it is trained), and the trained tokens are the response only."""
    cfg = _rl_cfg(hints=True, oversample=1, steps=3, buckets="1,2,3")
    cfg.hint.samples, cfg.hint.gamma, cfg.hint.hard_below = 6, 0.5, 0.9
    run_rl(tiny["cfg"], tiny["state"], tiny["space"], tiny["codec"], cfg, tmp_path / "hints", progress=False)
    records = _records(tmp_path / "hints")
    rates = next(r for r in records if r.get("hints") == "pass_init")
    task, codec = tiny["task"], tiny["codec"]
    hinted = 0
    for r in (r for r in records if "reward" in r):
        shares = []
        for q in r["queries"]:
            item = task.item(cfg.seed, q, (1, 2, 3))
            reference = codec.encode(item.answer)
            rate = rates[f"pass_init/{task.buckets[item.bucket]}"]
            n = len(hint_tokens(reference, hint_fraction(r["step"], rate, cfg.hint)))
            shares.append(n / len(reference))
            hinted += n > 0
        assert r["hint_fraction"] == pytest.approx(float(np.mean(shares)))
    assert hinted > 0  # the 6-digit bucket was never seen in SFT: it is hard
    # hint tokens are context, not targets: the trained token slots are the sampled ones only
    rb = response_batch([[1, 20, 21, 22, 23]], [[24, 25]], [[-0.1, -0.2]], [[0, 0]], 0)
    assert rb.mask.tolist() == [[True, True]] and rb.where.tolist() == [[4, 5]]
