"""Checks of the pipeline's wire and weight push, the push check's and the guard's statistics, the ranks' sampling
seeds, the roles, the mode choice's edges and compare's mean of evaluated steps, each by hand on small inputs: the
bugs benchmarks/mutants.py plants there fail one of these."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_pipeline import LIMITS, scored_batch, shipment

from fasttnt.config import load_config
from fasttnt.pipeline import weights as weights_mod
from fasttnt.pipeline import wire


def _names(buckets) -> list[list[str]]:
    return [[name for name, _ in bucket] for bucket in buckets]


class TestWire:
    def _message(self, **fields):
        return wire.encode(shipment(7, 3, probe_version=1, probe_logp=-torch.rand(6), **fields))

    def test_each_field_arrives_in_its_own_dtype_at_an_offset_of_8_bytes(self):
        want = scored_batch(7)
        header, payload = self._message()
        layout, size = wire.payload_layout(header, worker="w", limits=LIMITS)
        assert size == payload.numel() and size % 8 == 0
        assert all(at % 8 == 0 for _, dtype, at, _ in layout if dtype is not None)
        got = wire.decode(header, payload, worker="w", limits=LIMITS).scored
        b, w = got.batch, want.batch
        assert b.forced.dtype == w.forced.dtype == torch.int8, "precondition and check: the engine's int8 codes"
        assert got.rewards.solution_len.dtype == want.rewards.solution_len.dtype == torch.int32
        for name in ("response_ids", "cu_seqlens", "truncated", "rollout_logp", "behaviour_first_logp"):
            assert getattr(b, name).dtype == getattr(w, name).dtype and torch.equal(getattr(b, name), getattr(w, name))

    def test_the_step_and_the_version_come_back_in_their_places(self):
        got = wire.decode(*wire.encode(shipment(7, 5, version=3)), worker="w", limits=LIMITS)
        assert (got.step, got.version) == (5, 3)

    @pytest.mark.parametrize(("field", "code"), [("rewards", 1), ("solution_len", 1), ("forced", 3)])
    def test_a_field_announced_in_another_dtype_is_refused(self, field, code):
        header, _ = self._message()
        at = wire.HEADER_INTS + 2 * [name for name, _ in wire.MESSAGE_FIELDS].index(field)
        assert header[at] != code, "precondition: another dtype's code"
        header[at] = code
        with pytest.raises(wire.WorkerError, match=f"field {field} has dtype code {code}"):
            wire.payload_layout(header, worker="w", limits=LIMITS)

    def test_a_negative_count_and_another_field_count_are_refused(self):
        header, _ = self._message()
        wire.payload_layout(header, worker="w", limits=None)  # precondition: as sent
        bad = header.clone()
        bad[wire.HEADER_INTS + 2 * [name for name, _ in wire.MESSAGE_FIELDS].index("rewards") + 1] = -8
        with pytest.raises(wire.WorkerError, match="field rewards has dtype code 2, count -8"):
            wire.payload_layout(bad, worker="w", limits=None)
        bad = header.clone()
        bad[wire.HEADER_INTS - 1] -= 1
        with pytest.raises(wire.WorkerError, match="not a fasttnt shipment of this version"):
            wire.payload_layout(bad, worker="w", limits=None)

    def test_the_text_is_bounded_by_the_announced_response_tokens(self):
        assert wire.most_elements(LIMITS, 10)["text_bytes"] == 10 * wire.MAX_TOKEN_BYTES
        assert wire.most_elements(LIMITS, 10)["counts"] == 3 and wire.most_elements(LIMITS, 10)["times"] == 4

    def test_a_whole_probe_of_more_tokens_than_rows_fits_the_limits(self):
        n = LIMITS.rows + 5  # the probe's group: at most row_tokens tokens a row
        assert n <= LIMITS.rows * LIMITS.row_tokens, "precondition: within the per-token bound"
        header, payload = wire.encode(shipment(7, 3, probe_version=1, probe_logp=-torch.rand(n)))
        got = wire.decode(header, payload, worker="w", limits=LIMITS)
        assert got.probe_logp.numel() == n

    def test_a_shipment_of_no_draws_is_refused(self):
        header, payload = self._message()
        wire.decode(header, payload, worker="w", limits=LIMITS)  # precondition: as sent
        header[3] = 0
        with pytest.raises(wire.WorkerError, match="varied flags, times or draws"):
            wire.decode(header, payload, worker="w", limits=LIMITS)

    @pytest.mark.parametrize(
        "field",
        ["prompt_lengths", "truncated", "forced", "text_lengths", "correct", "rewards", "non_thinking", "solution_len",
         "hacked", "levels", "behaviour_first_logp", "behaviour_think_end_logp", "rollout_logp"],
    )  # fmt: skip
    def test_a_field_one_short_is_refused(self, field):
        fields = wire.to_fields(scored_batch(7))
        wire.from_fields(dict(fields), worker="w", vocab=LIMITS.vocab)  # precondition: whole
        fields[field] = fields[field][:-1]
        with pytest.raises(wire.WorkerError, match="malformed batch"):
            wire.from_fields(fields, worker="w", vocab=LIMITS.vocab)

    @pytest.mark.parametrize("case", ["group size 0", "bounds from 1", "prompt lengths", "counts of 4"])
    def test_inconsistent_fields_are_refused_as_malformed(self, case):
        fields = wire.to_fields(scored_batch(7))
        wire.from_fields(dict(fields), worker="w", vocab=LIMITS.vocab)  # precondition: whole
        if case == "group size 0":
            fields["counts"] = torch.tensor([0, 0, 0])
        elif case == "bounds from 1":
            cu = fields["cu_seqlens"].clone()
            assert cu[1] >= 1, "precondition: the first response is not empty"
            cu[0] = 1
            fields["cu_seqlens"] = cu
        elif case == "prompt lengths":
            fields["prompt_lengths"] = fields["prompt_lengths"] + torch.nn.functional.one_hot(torch.tensor(0), 12)
        else:
            fields["counts"] = torch.cat([fields["counts"], fields["counts"][:1]])
        with pytest.raises(wire.WorkerError, match="malformed batch"):
            wire.from_fields(fields, worker="w", vocab=LIMITS.vocab)


class _Layers(torch.nn.Module):
    """``embed`` (64 bytes), ``model.layers.{0,1,2}.{a,b}`` (64 bytes each), ``final.norm`` (64 bytes): float32, in
    that order."""

    def __init__(self, numel: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.zeros(numel))
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList()
        for _ in range(3):
            layer = torch.nn.Module()
            layer.a, layer.b = torch.nn.Parameter(torch.zeros(numel)), torch.nn.Parameter(torch.zeros(numel))
            self.model.layers.append(layer)
        self.final = torch.nn.Module()
        self.final.norm = torch.nn.Parameter(torch.zeros(numel))


class _Mixed(torch.nn.Module):
    """Parameters of odd sizes and three dtypes: only 8-byte padding starts each where its dtype can be viewed."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.a = torch.nn.Parameter(torch.randn(3, generator=g))  # 12 bytes
        self.b = torch.nn.Parameter(torch.randn(2, generator=g, dtype=torch.float64))
        self.c = torch.nn.Parameter(torch.randn(3, generator=g).to(torch.bfloat16))  # 6 bytes
        self.d = torch.nn.Parameter(torch.randn(5, 1, generator=g, dtype=torch.float64))


class TestWeightPush:
    EXPECTED = (("embed", "model.layers.0.a", "model.layers.0.b"), ("model.layers.1.a", "model.layers.1.b"),
                ("model.layers.2.a", "model.layers.2.b"), ("final.norm",))  # fmt: skip
    ALL = tuple(name for bucket in EXPECTED for name in bucket)

    def test_buckets_end_between_layers_once_they_hold_bucket_bytes(self):
        # 128 bytes a bucket: embed (64) takes layer 0 whole (192), then a layer a bucket (128 each), then norm
        assert _names(weights_mod.layer_buckets(_Layers(), 128)) == [list(b) for b in self.EXPECTED]
        assert _names(weights_mod.layer_buckets(_Layers(), 10**6)) == [list(self.ALL)]

    def test_a_zero3_shard_counts_at_its_full_size(self):
        model = _Layers(numel=1)
        for p in model.parameters():
            p.ds_numel, p.ds_shape = 16, (16,)
        assert _names(weights_mod.layer_buckets(model, 128)) == [list(b) for b in self.EXPECTED]
        assert all(s.shape == (16,) for bucket in weights_mod.layout(model, 128) for s in bucket)

    def test_parameters_of_odd_sizes_and_mixed_dtypes_arrive_bit_for_bit(self):
        model = _Mixed()
        (bucket,) = weights_mod.layout(model, 10**6)
        packed = weights_mod._packed(list(model.parameters()))
        buffer = weights_mod.bucket_buffer(bucket, "cpu")
        assert buffer.numel() == packed.numel() == 16 + 16 + 8 + 40
        buffer.copy_(packed)
        views = weights_mod.bucket_views(bucket, buffer)
        for (name, got), (want_name, want) in zip(views, model.named_parameters(), strict=True):
            assert name == want_name and got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got.view(torch.uint8), want.detach().view(torch.uint8)), name

    def test_the_signature_tells_dtypes_apart(self):
        model = _Layers()
        other = _Layers().to(torch.bfloat16)
        assert [s.name for b in weights_mod.layout(other, 128) for s in b] == list(self.ALL), "precondition"
        assert weights_mod.signature(weights_mod.layout(model, 128)) != weights_mod.signature(
            weights_mod.layout(other, 128)
        )

    @pytest.mark.parametrize("header", ["magic 0", "one parameter more", "as sent"])
    def test_a_header_is_held_against_the_receivers_model(self, monkeypatch, header):
        buckets = weights_mod.layout(_Layers(), 128)
        count, sig = sum(len(b) for b in buckets), weights_mod.signature(buckets)
        sent = {"magic 0": [0, 5, count, sig], "one parameter more": [weights_mod.MAGIC, 5, count + 1, sig],
                "as sent": [weights_mod.MAGIC, 5, count, sig]}[header]  # fmt: skip
        monkeypatch.setattr(weights_mod, "recv_from", lambda t, *a, **k: t.copy_(torch.tensor(sent)))
        if header == "as sent":
            assert weights_mod.recv_header(buckets, src=0) == 5
            return
        with pytest.raises(weights_mod.WeightPushError):
            weights_mod.recv_header(buckets, src=0)


class TestPushCheck:
    def _push(self, probes: list[torch.Tensor], limit: float = 0.1):
        from fasttnt.pipeline.push import WeightPush

        push = object.__new__(WeightPush)
        push.cfg = SimpleNamespace(rollout=SimpleNamespace(max_logp_diff=limit))
        push.worker_ranks, push.checks, push.probes = list(range(1, len(probes) + 1)), True, {4: probes}
        return push

    @staticmethod
    def _shipped(*logps, version: int = 4):
        return [SimpleNamespace(probe_version=version, probe_logp=logp) for logp in logps]

    def test_differences_of_both_signs_do_not_cancel(self):
        from fasttnt.guard import StaleWeightsError

        mine = -torch.ones(4)
        theirs = mine + torch.tensor([0.5, -0.5, 0.5, -0.5])
        with pytest.raises(StaleWeightsError, match=r"differ from the trainer's by 0\.5 per token"):
            self._push([mine])._check(5, self._shipped(theirs))

    def test_the_statistic_is_a_mean_per_token_and_the_logged_one_the_largest(self):
        mine = [-torch.ones(8), -torch.ones(8)]
        diff = self._push(mine)._check(5, self._shipped(mine[0] + 0.01, mine[1] - 0.05))  # 0.4 summed: within 0.1
        assert diff == pytest.approx(0.05, rel=1e-6)

    def test_a_worker_that_checked_no_version_beside_one_that_did_is_refused(self):
        from fasttnt.pipeline.wire import WorkerError

        push = self._push([-torch.ones(4), -torch.ones(4)])
        shipped = [*self._shipped(-torch.ones(4)), SimpleNamespace(probe_version=-1, probe_logp=None)]
        with pytest.raises(WorkerError, match="checked weight version -1 where another worker checked version 4"):
            push._check(5, shipped)

    def test_the_limits_of_a_shipment(self):
        from fasttnt.pipeline.push import checks_pushes
        from fasttnt.pipeline.remote import shipment_limits

        cfg = load_config(None, ["rollout.prompts_per_step=8", "rollout.group_size=4", "rollout.dynamic_sampling=true",
                                 "rollout.max_draws=3", "rollout.max_new_tokens=20", "rollout.workers=2"])  # fmt: skip
        model = SimpleNamespace(get_input_embeddings=lambda: torch.nn.Embedding(300, 8))
        assert shipment_limits(cfg, model, 50) == wire.Limits(rows=8 // 2 * 4 * 3, row_tokens=50 + 20, vocab=300)
        for k in (0, 1):
            cfg = load_config(None, ["rollout.max_logp_diff=0.1", f"rollout.max_staleness={k}", "rollout.workers=1"])
            assert checks_pushes(cfg) == (k == 1)

    def test_a_step_of_two_workers_is_as_old_as_its_oldest(self):
        from fasttnt.pipeline.remote import whole_step

        joined = whole_step([shipment(7, 5, version=4), shipment(8, 5, version=3)])
        assert (joined.step, joined.version) == (5, 3)


class TestRoles:
    def test_the_last_ranks_generate(self):
        from fasttnt.pipeline.roles import PipelineRanks

        ranks = PipelineRanks(world=5, workers=2)
        assert list(ranks.trainer_ranks) == [0, 1, 2] and list(ranks.worker_ranks) == [3, 4]
        assert [ranks.is_worker(r) for r in range(5)] == [False, False, False, True, True]

    def test_the_trainers_times_their_mini_batches_must_divide_the_prompts(self):
        from fasttnt.config import ConfigError
        from fasttnt.pipeline.roles import PipelineRanks

        cfg = load_config(None, ["rollout.prompts_per_step=4", "rollout.workers=1", "loss.mini_batches=4"])
        assert PipelineRanks.of(cfg, 2).trainer_ranks == range(1), "precondition: one trainer takes 4 mini-batches of 1"
        # two trainers divide the 4 prompts, but not into 4 mini-batches each
        with pytest.raises(ConfigError, match=r"2 trainers x loss\.mini_batches=4 do not divide"):
            PipelineRanks.of(cfg, 3)


class TestGuard:
    @staticmethod
    def _guard(limit: float, floor: float | None = None):
        from fasttnt.guard import StaleWeightGuard

        guard = object.__new__(StaleWeightGuard)
        guard.active, guard.engine, guard.limit, guard.bf16, guard.dist, guard.floor = (
            True,
            "vllm",
            limit,
            False,
            None,
            floor,
        )
        return guard

    def test_the_statistic_is_the_mean_absolute_difference_per_token(self):
        batch = SimpleNamespace(rollout_logp=-torch.ones(4))
        old = -torch.ones(4) + torch.tensor([0.25, -0.25, 0.25, -0.25])
        assert self._guard(0.1).engine_logp_diff(batch, old) == pytest.approx(0.25)

    def test_a_bf16_floor_raises_the_limit_and_never_lowers_it(self):
        from fasttnt.guard import StaleWeightsError

        batch = SimpleNamespace(rollout_logp=-torch.ones(4))
        self._guard(0.05, floor=0.1).check(2, batch, -torch.ones(4) + 0.2)  # within 3 x the floor
        with pytest.raises(StaleWeightsError):
            self._guard(0.05, floor=0.1).check(2, batch, -torch.ones(4) + 0.4)
        self._guard(0.3, floor=0.01).check(2, batch, -torch.ones(4) + 0.2)  # within the limit, past 3 x the floor


class TestSamplingSeeds:
    def test_each_rank_and_draw_of_a_step_samples_rows_of_its_own(self):
        from fasttnt.rollouts import Rollouts

        class Stop(Exception):
            pass

        calls = []

        def generate(prompts, group_size, *, seed, first_row, **_):
            calls.append((seed, first_row, len(prompts) * group_size, list(prompts)))
            raise Stop

        cfg = load_config(None, ["rollout.prompts_per_step=4", "rollout.group_size=2", "seed=3"])
        ranks, draws = 2, 3
        for draw in range(draws):
            for rank in range(ranks):
                stream = SimpleNamespace(take=lambda n, d=draw: [f"d{d}p{i}" for i in range(n)])
                engine = SimpleNamespace(generate=generate)
                rollouts = Rollouts(cfg, engine=engine, stream=stream, tokenizer=None, prompt=lambda p: p,
                                    think_end_id=0, markers=None, mode_mix=None, verifier=None, rank=rank,
                                    prompts_per_rank=2)  # fmt: skip
                with pytest.raises(Stop):
                    rollouts.draw(5, draw, None)
        assert len(calls) == ranks * draws
        from fasttnt.engines.sampler import step_seed

        assert {seed for seed, *_ in calls} == {step_seed(3, 5)}, "one seed a step: its rows tell draws apart"
        rows = sorted(r for _, first, n, _ in calls for r in range(first, first + n))
        assert rows == list(range(draws * 4 * 2)), "every (draw, rank) has rows of its own, none skipped"
        for draw in range(draws):
            prompts = [p for _, _, _, ps in calls[draw * ranks : (draw + 1) * ranks] for p in ps]
            assert prompts == [f"d{draw}p{i}" for i in range(4)], "the ranks share the draw's prompts"

    def test_runs_of_consecutive_seeds_never_share_a_calls_seed(self):
        from fasttnt.engines.sampler import step_seed

        seeds = [step_seed(run, step) for run in range(4) for step in range(1000)]
        assert len(set(seeds)) == len(seeds)


class TestModeChoice:
    def test_a_think_end_log_prob_rounded_above_0_is_p_1(self):
        from fasttnt.modes import evidence_choice, saturating_choice

        rewards = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0])  # thinking pays: a step at p = 1
        non_thinking = torch.tensor([True, True, False, False, True, True, False, False])
        at_one = saturating_choice(rewards, non_thinking, torch.tensor([0.0]), 8, (0, 0))
        assert torch.isfinite(at_one).all() and at_one.abs().sum() > 0, "precondition: a step at p = 1"
        for choice in (saturating_choice, evidence_choice):
            above = choice(rewards, non_thinking, torch.tensor([1e-6]), 8, (0, 0))
            assert torch.equal(above, choice(rewards, non_thinking, torch.tensor([0.0]), 8, (0, 0)))

    def test_the_centered_mean_is_over_the_groups_that_hold_both_modes(self):
        from fasttnt.modes import centered_choice

        # groups of 2: gaps 1 and 0.5 (a direct row, then a thinking row), a group of two direct rows (gap 0), and a
        # group of gap 1.5 led by its thinking row: the mean decoupled step of the three with both modes, 1, is taken
        # from each of them; the group of one mode carries nothing
        mode_gap = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, 0.0, -1.5, 1.5])
        non_thinking = torch.tensor([True, False, True, False, True, True, False, True])
        got = centered_choice(mode_gap, non_thinking, 2)
        assert torch.equal(got, torch.tensor([0.0, 0.0, -0.5, 0.0, 0.0, 0.0, 0.0, 0.5]))

    def test_auto_is_decoupled_only_with_forced_rows(self):
        from fasttnt.modes import mode_advantage_of

        assert mode_advantage_of(load_config(None, [])) == "shared"
        assert mode_advantage_of(load_config(None, ["rollout.forced_non_thinking=0.25"])) == "decoupled"

    @pytest.mark.parametrize(("rule", "faded"), [("centered", False), ("saturating", False), ("decoupled", True)])
    def test_the_unfaded_choices_have_no_floor(self, rule, faded):
        from fasttnt.modes import ModeMix

        mix = ModeMix(2, 0, 8, "policy", rule, "auto")
        assert (mix.floor_logp(-3.0) is not None) == faded


class TestCompare:
    def test_each_evaluated_step_reads_its_own_model_and_writes_its_own_folder(self, tmp_path, monkeypatch):
        # a run trained before (its final/ and stamp in place), evaluated at steps 2 and 4 of 4: step 2 from its
        # checkpoint, step 4 from final/, each into eval/step-N; run_eval recorded, not run
        import fasttnt.compare.jobs as jobs
        from fasttnt.checkpoint import checkpoint_paths
        from fasttnt.compare.plan import Run, fingerprint
        from fasttnt.evaluate import EvalSettings

        cfg = load_config(None, ["steps=4"])
        run = Run("tnt", 0, 0, tmp_path / "run", cfg)
        for folder in (run.out / "final", checkpoint_paths(run.out / "checkpoints", 2)[0]):
            folder.mkdir(parents=True)
            (folder / "config.json").write_text("{}")
        (run.out / "compare_run.json").write_text(json.dumps({"config_sha256": fingerprint(cfg)}))
        calls = []

        def recorded(models, benchmarks, settings, out):
            calls.append((Path(models[0]), Path(out)))
            return {"results": {models[0]: {"synthetic": {"acc": 50.0 + len(calls), "len": 10.0, "n": 4}}}}

        monkeypatch.setattr(jobs, "run_eval", recorded)
        monkeypatch.setattr(jobs, "mean_evaluation", lambda evaluations: evaluations[-1])
        result = jobs.TrainAndEvaluate(run, EvalSettings(), steps=(2, 4))(progress=False)
        assert len(calls) == 2, "precondition: both steps evaluated"
        assert calls == [(checkpoint_paths(run.out / "checkpoints", 2)[0], run.out / "eval" / "step-2"),
                         (run.out / "final", run.out / "eval" / "step-4")]  # fmt: skip
        assert [result["by_step"][s]["acc"] for s in (2, 4)] == [51.0, 52.0]

    def test_flags_are_kept_and_the_token_efficiency_is_that_of_the_means(self):
        from fasttnt.compare.jobs import mean_evaluation
        from fasttnt.metrics import token_efficiency

        one = {"acc": 50.0, "len": 16.0, "te": token_efficiency(50.0, 16.0), "hacked": True, "n": 8}
        two = {"acc": 70.0, "len": 36.0, "te": token_efficiency(70.0, 36.0), "hacked": False, "n": 8}
        mean = mean_evaluation([one, two])
        assert mean["hacked"] is True and mean["n"] == 8
        assert mean["te"] == pytest.approx(token_efficiency(60.0, 26.0))
        assert mean["te"] != pytest.approx((one["te"] + two["te"]) / 2), "precondition: the two differ"
