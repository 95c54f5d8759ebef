"""Every CLI default is written once: each option's default equals its dataclass field, and the options
a user gives reach the config the library receives."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist
import typer.main
from typer.testing import CliRunner

import slimspec_convert.cli.train as cli_train
from finetune.config import FinetuneConfig
from slimspec_convert.cli import app
from slimspec_convert.cli.app import csv_items
from slimspec_convert.data.distill import DistillConfig
from slimspec_convert.data.self_prompts import SelfPromptConfig
from slimspec_convert.decoding.config import DraftConfig, GenerateConfig, SamplingConfig
from slimspec_convert.measure.e2e import BenchE2EConfig
from slimspec_convert.measure.head_latency import BenchHeadConfig
from slimspec_convert.workflows.convert import ConvertConfig
from slimspec_convert.workflows.rank_sweep import RankSweepConfig
from slimspec_convert.workflows.trim import TrimConfig

# command path -> (dataclass defaults, CLI option -> field where the names differ)
OWNERS = {
    ("convert",): ([ConvertConfig], {}),
    ("inspect",): ([ConvertConfig], {}),
    ("generate",): (  # later owners win: GenerateConfig.lookup (None = planned) over DraftConfig.lookup
        [SamplingConfig, DraftConfig, GenerateConfig],
        {"limit": "max_prompts", "draft": "draft_method"},
    ),
    ("finetune",): ([FinetuneConfig], {}),
    ("train-drafter",): ([FinetuneConfig.for_new_drafter], {}),
    ("trim",): ([TrimConfig], {}),
    ("distill",): ([DistillConfig], {}),
    ("self-prompts",): ([SelfPromptConfig], {}),
    ("rank-sweep",): ([RankSweepConfig], {}),
    ("bench", "head"): ([BenchHeadConfig], {}),
    ("bench", "e2e"): ([BenchE2EConfig], {"draft": "draft_method"}),
}
NOT_CONFIG = {"json_out", "threads", "resume", "self_distill", "eval_data", "teacher_drafter", "cache"}


def _field_defaults(owner) -> dict:
    if isinstance(owner, type):
        out = {}
        for f in dataclasses.fields(owner):
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = f.default_factory()
        return out
    return dataclasses.asdict(owner())  # a constructor such as FinetuneConfig.for_new_drafter


def _command(path):
    cmd = typer.main.get_command(app)
    for name in path:
        cmd = cmd.commands[name]
    return cmd


def _as_field_value(value, field_value):
    if isinstance(field_value, tuple) and isinstance(value, str):
        return tuple(type(field_value[0])(x) if field_value else x for x in csv_items(value, "option"))
    if isinstance(field_value, tuple) and isinstance(value, list):
        return tuple(value)
    return value


@pytest.mark.parametrize("path", list(OWNERS), ids=" ".join)
def test_every_cli_default_equals_its_dataclass_field(path):
    owners, renames = OWNERS[path]
    fields = {}
    for owner in owners:
        fields.update(_field_defaults(owner))
    checked = 0
    for param in _command(path).params:
        if param.required or param.name in NOT_CONFIG:
            continue
        name = renames.get(param.name, param.name)
        if name not in fields:
            continue
        checked += 1
        got = _as_field_value(param.default, fields[name])
        if fields[name] == () and param.default is None:  # repeatable option: nothing given = ()
            continue
        assert got == fields[name], f"slimspec {' '.join(path)} --{param.name.replace('_', '-')}"
    assert checked >= 1


def test_finetune_and_train_drafter_pass_their_options_to_the_config(monkeypatch, tmp_path):
    seen = {}

    def fake_finetune(target, drafter, data, out, cfg, **kw):
        seen["finetune"] = cfg
        return _Done()

    def fake_train(target, data, out, cfg, **kw):
        seen["train"] = cfg
        return _Done()

    monkeypatch.setattr(cli_train, "run_finetune", fake_finetune)
    monkeypatch.setattr(cli_train, "run_train_drafter", fake_train)
    common = ["--target", "t", "--data", "d.jsonl", "--out", str(tmp_path / "o"), "--steps", "2"]
    common += ["--lr", "0.002", "--ttt-steps", "2", "--batch-size", "3", "--max-length", "48"]
    common += ["--warmup-steps", "0", "--seed", "3", "--device", "cpu", "--dtype", "bf16"]
    runner = CliRunner()
    assert runner.invoke(app, ["train-drafter", *common, "--train", "body"]).exit_code == 0
    assert runner.invoke(app, ["finetune", *common, "--drafter", "x"]).exit_code == 0
    for key, train in (("train", "body"), ("finetune", "head")):
        cfg = seen[key]
        assert (cfg.steps, cfg.lr, cfg.ttt_steps, cfg.batch_size) == (2, 0.002, 2, 3)
        assert (cfg.max_length, cfg.warmup_steps, cfg.seed, cfg.train) == (48, 0, 3, train)
        assert (cfg.device, cfg.dtype) == ("cpu", "bf16")


def test_finetune_report_is_printed_by_rank_zero_only(monkeypatch, tmp_path):
    """torchrun: every rank returns the report; only rank 0 prints it (one JSON document on stdout)."""
    monkeypatch.setattr(cli_train, "run_finetune", lambda *a, **kw: _Done())
    args = ["finetune", "--target", "t", "--drafter", "x", "--data", "d.jsonl", "--out", str(tmp_path / "o")]
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    for rank, printed in ((1, ""), (0, "done\n")):
        monkeypatch.setattr(dist, "get_rank", lambda rank=rank: rank)
        result = CliRunner().invoke(app, args)
        assert (result.exit_code, result.stdout) == (0, printed)


def test_train_drafter_defaults_train_every_parameter():
    cfg = FinetuneConfig.for_new_drafter()
    assert (cfg.train, cfg.lr, cfg.steps, cfg.ttt_steps, cfg.max_length) == ("all", 1e-3, 200, 7, 512)
    rec = FinetuneConfig()  # the short recovery recipe of the sweep (finetune/config.py)
    assert (rec.train, rec.lr, rec.steps, rec.ttt_steps, rec.max_length) == ("head", 2e-3, 100, 3, 256)
    assert FinetuneConfig.for_new_drafter(steps=5).steps == 5


class _Done:
    def summary(self) -> str:
        return "done"

    def to_dict(self) -> dict:
        return {}


def test_device_and_dtype_default_to_auto_on_every_command_that_runs_a_model():
    """auto: cuda when available, bf16 there, float32 on the CPU (devices.resolve_dtype)."""
    for owner in (GenerateConfig, BenchE2EConfig, RankSweepConfig, FinetuneConfig):
        assert (
            owner.__dataclass_fields__["device"].default,
            owner.__dataclass_fields__["dtype"].default,
        ) == (
            "auto",
            "auto",
        ), owner.__name__
    assert (ConvertConfig().device, ConvertConfig().calibration_dtype, ConvertConfig().calibrate) == (
        "auto",
        "auto",
        True,
    )
    for path in [
        ("convert",),
        ("generate",),
        ("finetune",),
        ("train-drafter",),
        ("rank-sweep",),
        ("bench", "e2e"),
    ]:
        assert "device" in {p.name for p in _command(path).params}, path


def test_generate_and_convert_pass_device_dtype_and_calibration_to_the_config(monkeypatch, tmp_path):
    import slimspec_convert.cli.convert as cli_convert
    import slimspec_convert.cli.generate as cli_generate

    seen = {}

    def fake_generate(target, drafter, prompt, prompts, gcfg, dcfg, scfg, *hooks, on_mode=None):
        seen["generate"], seen["lookup"] = gcfg, dcfg
        return []

    def fake_convert(src, out, cfg):
        seen["convert"] = cfg
        return _Report()

    monkeypatch.setattr(cli_generate, "generate_from_paths", fake_generate)
    monkeypatch.setattr(cli_convert, "convert_checkpoint", fake_convert)
    runner = CliRunner()
    args = ["generate", "--target", "t", "--drafter", "none", "--prompt", "hi", "--device", "cuda:1"]
    assert runner.invoke(app, [*args, "--dtype", "fp16", "--json", "--lookup", "3"]).exit_code == 0
    assert (seen["generate"].device, seen["generate"].dtype) == ("cuda:1", "fp16")
    assert (seen["generate"].draft_method, seen["generate"].lookup) == ("auto", 3)  # 3 by hand: not planned
    assert (seen["lookup"].lookup, seen["lookup"].lookup_min_ngram, seen["lookup"].lookup_max_ngram) == (
        3,
        2,
        3,
    )
    args = ["convert", "src", str(tmp_path / "o"), "--target", "t", "--no-calibration", "--device", "cpu"]
    # --threads pins the thread count: the default's notice depends on the machine's load at the time
    res = runner.invoke(app, [*args, "--calibration-dtype", "bf16", "--threads", "1"])
    assert res.exit_code == 0, res.output
    cfg = seen["convert"]
    assert (cfg.calibrate, cfg.device, cfg.calibration_dtype, cfg.target) == (False, "cpu", "bf16", "t")
    assert res.stderr == "warning: check the head\n"  # the report's warnings go to stderr, one line each
    shape = runner.invoke(
        app, ["generate", "--target", "t", "--drafter", "d", "--prompt", "x", "--depth", "3"]
    )
    assert shape.exit_code == 2 and "--depth sets a shape by hand: give --draft chain or --draft tree" in (
        shape.output
    )
    bad = runner.invoke(
        app, ["generate", "--target", "t", "--drafter", "none", "--prompt", "x", "--device", "gpu"]
    )
    assert (
        bad.exit_code == 2 and "GenerateConfig.device='gpu': expected auto, cpu, cuda or cuda:N" in bad.output
    )


class _Report:
    warnings = ["check the head"]

    def summary(self) -> str:
        return "converted"
