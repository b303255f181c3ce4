"""`scaletrain plan`: bad input refused before any work (exit 2, once, in the CLI's
words); a paper plan's table; `plan --check RUN` on a tiny real run."""

from __future__ import annotations

from pathlib import Path

import pytest

from scaletrain import cli
from tests.cpu_hardware import cpu_hardware_file


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = cli.main(["plan", *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--devices", "0", "--hardware", "h100-sxm"], "--devices 0 must be a whole number >= 1"),
        (["--devices", "2", "--hardware", "tpu-v9"], "--hardware tpu-v9"),
        (["--devices", "2", "--hardware", "h100"], "--hardware h100-sxm"),
        (
            ["--devices", "2", "--hardware", "h100-sxm", "--precision", "fp8"],
            "--precision fp8 is not known",
        ),
        (
            ["--devices", "2", "--hardware", "h100-sxm", "--batch-size", "0"],
            "--batch-size 0 must be",
        ),
        (["--devices", "2", "--hardware", "h100-sxm", "--recipe", "nope"], "--recipe nope"),
        (
            ["--devices", "2", "--hardware", "h100-sxm", "--model", "no_such_module_x:build"],
            "no_such_module_x",
        ),
        (
            ["--devices", "2", "--hardware", "h100-sxm", "--recipe", "convnet", "--seq-len", "64"],
            "--seq-len",
        ),
        (
            ["--devices", "2", "--hardware", "h100-sxm", "--ac-every", "2"],
            "--ac-every 2 picks every k-th block",
        ),
        ([], "--devices is missing"),
        (["--check", "RUN", "--devices", "2"], "--check RUN takes the model"),
        (
            ["--check", "/no/such/run", "--hardware", "h100-sxm"],
            "is not a finished run with a ledger",
        ),
        (["--calibrate", "--devices", "2"], "--calibrate measures this machine and plans nothing"),
        # --check took these and changed nothing (the run's config.json says them); a
        # value equal to the plan's default is given all the same.
        (["--check", "RUN", "--precision", "bf16-mixed"], "--precision bf16-mixed was given too"),
        (["--check", "RUN", "--precision", "32"], "--precision 32 was given too"),
        (["--check", "RUN", "--ac", "full"], "--ac full was given too"),
        (["--check", "RUN", "--ac", "none"], "--ac none was given too"),
        (["--check", "RUN", "--ac-every", "2"], "--ac-every 2 was given too"),
        (
            ["--check", "RUN", "--float8"],
            "compile, float8) from the run's config.json, but --float8 was given too",
        ),
        (
            ["--devices", "2", "--hardware", "a100-sxm", "--recipe", "gpt", "--float8"],
            "--float8: a100-sxm's hardware file gives no fp8 FLOP/s",
        ),
        (
            ["--devices", "2", "--hardware", "h100-sxm", "--recipe", "convnet", "--float8"],
            "no Linear layer in the blocks of this ConvNet has input and output widths "
            "divisible by 16, which float8 matmuls need. Fix: widths such as multiples of 16, "
            "or plan without --float8.",
        ),
        (
            ["--calibrate", "/no/such/dir/hw.toml", "--precision", "bf16-mixed"],
            "--precision bf16-mixed was given too",
        ),
    ],
)
def test_bad_input_exits_2_before_any_work(
    capsys: pytest.CaptureFixture[str], args: list[str], words: str
) -> None:
    code, err = _plan(capsys, *args)
    assert code == 2
    assert words in err
    assert err.count("scaletrain: error:") == 1


def test_without_hardware_or_a_calibration_the_fix_is_named(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SCALETRAIN_CACHE_DIR", str(tmp_path))
    code, err = _plan(capsys, "--devices", "2")
    assert code == 2
    assert "--calibrate once to measure it" in err and "--hardware h100-sxm" in err


def test_calibrate_makes_its_own_default_directory(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a fresh machine `plan --calibrate` (the docs' command) refused: "cannot write
    ~/.cache/scaletrain/hardware/HOST.toml: its directory does not exist". The
    measurement itself is replaced here (it spawns processes); its own check of the
    target runs."""
    from types import SimpleNamespace

    import scaletrain.hardware.calibrate as calibration

    monkeypatch.setenv("SCALETRAIN_CACHE_DIR", str(tmp_path / "fresh"))
    written: list[Path] = []

    def measured(path: str, **_: object) -> object:
        calibration._check_target(Path(path), False)
        written.append(Path(path))
        return SimpleNamespace(description="measured")

    monkeypatch.setattr(calibration, "calibrate", measured)
    assert cli.main(["plan", "--calibrate"]) == 0, capsys.readouterr().err
    assert written and written[0].parent == tmp_path / "fresh" / "hardware"
    assert f"wrote {written[0]}: measured" in capsys.readouterr().out


def test_a_reader_that_goes_away_ends_the_plan_quietly(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`scaletrain plan ... | head -6` ended in a 10-line BrokenPipeError traceback."""
    import io
    import sys

    class Gone(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self) -> None:  # as a real pipe's, which still holds what was written
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", Gone())
    code = cli.main(["plan", "--devices", "2", "--hardware", "h100-sxm", "--recipe", "split-net"])
    assert code == 141
    assert capsys.readouterr().err == ""
    # A broken pipe that is not stdout's (the user's code's socket) is an error to show.
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.setattr("scaletrain.cli._command", lambda argv: (_ for _ in ()).throw(
        BrokenPipeError(32, "Broken pipe")))  # fmt: skip
    with pytest.raises(BrokenPipeError):
        cli.main(["plan"])


def test_env_whose_reader_is_gone_ends_quietly_with_141_too(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`scaletrain env` prints through rich, whose own broken-pipe rule exited 1."""
    import io
    import sys

    class Gone(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self) -> None:
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", Gone())
    assert cli.main(["env"]) == 141
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("entry", ["python -m scaletrain", "scaletrain"])
def test_every_command_ends_quietly_with_141_when_its_reader_is_gone(entry: str) -> None:
    """`scaletrain plan ... | head -3` printed a BrokenPipeError traceback and exited 1
    (an unbuffered stdout: the failed write left nothing for the rule's flush to fail
    on), or "Exception ignored ... BrokenPipeError" and 120 (Python's flush at exit,
    after main returned); --help exited 0 (argparse drops the error). Through a real
    pipe whose reader closes first, with both entry points."""
    import os
    import shutil
    import subprocess
    import sys

    import scaletrain

    script = shutil.which("scaletrain", path=str(Path(sys.executable).parent))
    if entry == "python -m scaletrain":
        command = [sys.executable, "-m", "scaletrain"]
    elif script is not None:
        command = [script]
    else:  # not installed: what the console script runs
        command = [sys.executable, "-c", "import sys; from scaletrain.cli import main; "
                   "sys.exit(main())"]  # fmt: skip
    env = dict(os.environ)
    src = str(Path(scaletrain.__file__).parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    plan = ["plan", "--recipe", "split-net", "--devices", "2", "--hardware", "h100-sxm"]
    for args, unbuffered in [(plan, "1"), (plan, ""), (["--help"], "1"), (["--version"], "")]:
        env["PYTHONUNBUFFERED"] = unbuffered
        proc = subprocess.Popen(
            [*command, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        assert proc.stdout is not None
        proc.stdout.close()  # as `| head` does once it has read its lines
        _, err = proc.communicate(timeout=120)
        assert (proc.returncode, err.decode()) == (141, ""), (args, unbuffered)


def test_recipe_and_model_together_are_refused_by_the_parser(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["plan", "--devices", "2", "--recipe", "gpt", "--model", "m:f"])
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_paper_plan_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["plan", "--recipe", "gpt", "--devices", "8", "--hardware", "a100-sxm"])
    out = capsys.readouterr().out
    assert code == 0
    assert "fsdp x tp dp=2,tp=4" in out and "ddp x pp dp=2,pp=4 1f1b m=4" in out
    assert "fsdp-keep dp=8" in out and "tok/s/dev" in out
    assert "recommended:" in out and "assumption:" in out
    # The rows fit a terminal of 120 columns (they were 141 wide); the prose around
    # them wraps.
    head, rule, *rest = out.splitlines()[1:]
    rows = [head, rule, *(x for x in rest if x.startswith(("ddp", "fsdp", "tensor", "pipeline")))]
    assert set(rule) == {"-"} and len(rows) == 14, rows
    assert max(map(len, rows)) <= 120, max(rows, key=len)


def test_a_calibrated_file_plans_this_machine(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from scaletrain.hardware.calibrate import calibrated_path

    monkeypatch.setenv("SCALETRAIN_CACHE_DIR", str(tmp_path))
    mine = calibrated_path()
    mine.parent.mkdir(parents=True)
    cpu_hardware_file(mine)
    assert cli.main(["plan", "--recipe", "split-net", "--devices", "2"]) == 0
    out = capsys.readouterr().out
    assert "test-cpu" in out and "ddp dp=2" in out


@pytest.mark.timeout(240)
def test_check_puts_a_tiny_run_beside_its_prediction(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    code = cli.main(
        ["train", "--recipe", "split-net", "--nproc", "1", "--max-steps", "25",
         "--ledger-every", "10", "--eval-batches", "0", "--out", str(run)]
    )  # fmt: skip
    assert code == 0
    capsys.readouterr()
    hw = cpu_hardware_file(tmp_path / "cpu.toml")
    assert cli.main(["plan", "--check", str(run), "--hardware", str(hw)]) == 0
    out = capsys.readouterr().out
    assert "check: ddp dp=1" in out
    assert "ms predicted" in out and "ms measured (" in out and "%)" in out
    assert "MiB measured (" in out and "RSS growth after setup" in out


def test_the_table_says_what_was_planned_and_what_to_do_when_nothing_fits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The header named neither the model's size nor its sequence (a config.json of
    defaults planned a 7B model unseen), the `*` had no legend, and "nothing fits" said
    nothing of what to change."""
    from dataclasses import replace

    from scaletrain.hardware import load, write

    assert cli.main(["plan", "--recipe", "gpt", "--devices", "2", "--hardware", "h100-sxm"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert "(867,072 parameters, 64 tokens a sample) on 2 device(s)" in head, head
    assert "* the recommended row" in head
    small = replace(load(str(cpu_hardware_file(tmp_path / "cpu.toml"))), name="tiny", memory=1)
    write(small, tmp_path / "tiny.toml")
    hw = str(tmp_path / "tiny.toml")
    assert cli.main(["plan", "--recipe", "split-net", "--devices", "2", "--hardware", hw]) == 0
    out = capsys.readouterr().out
    assert "nothing fits" in out and "Fix: more devices, a smaller --batch-size" in out, out


def test_the_help_names_every_recipe_precision_and_profile(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--recipe R: a recipe (default convnet)` named none of them; the help's lists are
    written out (the registries import torch), so this keeps them whole: the recipes,
    the precisions and the shipped hardware profiles."""
    from scaletrain.hardware import shipped
    from scaletrain.precision import PRECISIONS
    from scaletrain.train.recipes import RECIPES

    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"a recipe: {', '.join(sorted(RECIPES))} (default convnet)" in text, text
    assert all(p in text for p in PRECISIONS)
    profiles = text.partition("a shipped profile (")[2].partition(")")[0].split(", ")
    assert sorted(profiles) == shipped(), text


def _ledger_run(
    path: Path,
    *,
    device: str = "cpu",
    steps: int = 12,
    memory: bool = True,
    every: int = 50,
    **config: object,
) -> Path:
    """A finished run as `scaletrain train` leaves it, written out by hand (no training):
    its config.json and rank 0's ledger, `steps` steps of 10 ms and, if `memory`, the
    memory line a window writes."""
    import json

    from scaletrain.observe.metrics.phases import PHASES

    (path / "observe").mkdir(parents=True)
    settings = {"recipe": "split-net", "strategy": "ddp", "nproc": 1, "batch_size": 8,
                "ledger_every": 50, "run": {"world_size": 1, "device": device}, **config}  # fmt: skip
    (path / "config.json").write_text(json.dumps(settings))
    header = {"kind": "run", "v": 1, "rank": 0, "world_size": 1, "device": device,
              "every": every, "phases": list(PHASES)}  # fmt: skip
    lines: list[dict[str, object]] = [header]
    forward = [0.0, 0.0, 0.004, 0.006] + [0.0] * (len(PHASES) - 4)
    lines += [{"kind": "step", "step": s, "t": float(s), "wall": 0.01, "p": forward,
               "flags": ["warmup"] if s == 1 else []} for s in range(1, steps + 1)]  # fmt: skip
    if memory:
        lines.append({"kind": "memory", "step": 10, "allocated_peak": None,
                      "reserved_peak": None, "rss_peak": 300 * 2**20, "rss_setup": 200 * 2**20})  # fmt: skip
    (path / "observe" / "rank0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_check_refuses_a_hardware_file_of_another_device_before_any_plan(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run trained on a CPU, checked with --hardware h100-sxm, printed "0.9 ms predicted,
    792 ms measured (-99.9%)" with no word that the H100 is not the machine it ran on."""
    import scaletrain.planner.check as check

    def no_plan(*a: object, **kw: object) -> None:
        raise AssertionError("planned")

    monkeypatch.setattr(check, "plan", no_plan)
    run = _ledger_run(tmp_path / "run")
    code, err = _plan(capsys, "--check", str(run), "--hardware", "h100-sxm")
    assert code == 2 and err.count("scaletrain: error:") == 1, err
    assert "the run trained on cpu, but --hardware h100-sxm is a cuda machine" in err, err
    assert "the hardware file of the machine the run trained on" in err
    assert "`scaletrain plan --calibrate`, then --check RUN without --hardware" in err
    # No calibration: its fix was "or plan on paper with --hardware h100-sxm", refused
    # just above.
    monkeypatch.setenv("SCALETRAIN_CACHE_DIR", str(tmp_path / "cache"))
    code, err = _plan(capsys, "--check", str(run))
    assert code == 2 and "this machine has no calibration" in err, err
    assert "on paper" not in err and "or --hardware FILE, the hardware file of the machine" in err
    # This machine's calibration, when it is another device's than the run's.
    from scaletrain.hardware import load, write
    from scaletrain.hardware.calibrate import calibrated_path

    calibrated_path().parent.mkdir(parents=True)
    write(load("h100-sxm"), calibrated_path())
    code, err = _plan(capsys, "--check", str(run))
    assert code == 2 and "this machine's calibration (" in err and "is a cuda machine's" in err
    # And a GPU run's on a CPU machine's file.
    gpu = _ledger_run(tmp_path / "gpu", device="cuda")
    hw = str(cpu_hardware_file(tmp_path / "cpu.toml"))
    code, err = _plan(capsys, "--check", str(gpu), "--hardware", hw)
    assert code == 2 and f"the run trained on cuda, but --hardware {hw} is a cpu machine" in err


def test_check_says_what_it_planned(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The check's first line named the layout alone, not the model, precision, batch
    or hardware file its prediction was made for, as `scaletrain plan`'s header does."""
    run = _ledger_run(tmp_path / "run")
    hw = cpu_hardware_file(tmp_path / "cpu.toml")
    assert cli.main(["plan", "--check", str(run), "--hardware", str(hw)]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert head.startswith("check: ddp dp=1 (the run's layout) for split-net ("), head
    assert "on 1 device(s), 1 node(s) of test-cpu" in head
    assert "precision 32, batch 8 per replica, activation checkpointing none" in head
    # A run that accumulated gradients is planned as it trained: 4 micro-steps a step
    # (it was priced as one, 6.1 ms against 47.6 measured).
    acc = _ledger_run(tmp_path / "acc", accumulate=4)
    assert cli.main(["plan", "--check", str(acc), "--hardware", str(hw)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "batch 8 per replica x 4 micro-steps" in lines[0], lines[0]
    from scaletrain.planner.check import check_run

    one, four = (check_run(r, str(hw)).predicted.time for r in (run, acc))
    assert four.compute > 2 * one.compute, (one, four)  # 4 forwards and backwards, 1 step
    code, err = _plan(capsys, "--check", str(acc), "--accumulate", "2")
    assert code == 2 and "--accumulate 2 was given too" in err, err


def test_check_plans_a_float8_run_in_float8(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run trained with --float8 was checked against a plan of the same run without it
    (the check read compile and the rest from its config.json, but not float8)."""
    import scaletrain.planner.check as check

    asked: dict[str, object] = {}

    def plan(*a: object, **kw: object) -> None:
        asked.update(kw)
        raise SystemExit(0)

    monkeypatch.setattr(check, "plan", plan)
    run = _ledger_run(tmp_path / "run", device="cuda", float8=True, compile=True)
    with pytest.raises(SystemExit):
        check.check_run(run, "h100-sxm")
    assert asked["float8"] is True and asked["compile"] is True
    # A hardware file without fp8 FLOP/s is refused in --check's words, not --float8's
    # (a flag --check refuses).
    code, err = _plan(capsys, "--check", str(run), "--hardware", "a100-sxm")
    assert code == 2 and "the run trained with --float8, and a100-sxm's hardware file" in err


def test_plan_float8_says_so_in_its_first_line(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--recipe", "gpt", "--devices", "2", "--hardware", "h100-sxm", "--float8"]
    assert cli.main([*args, "--precision", "bf16-mixed"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert "precision bf16-mixed, float8, batch 32 per replica" in head, head


def test_a_plan_without_precision_or_ac_plans_32_without_checkpointing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--precision and --ac default to None on the command line (so --check can refuse
    them); a plan resolves them as before."""
    assert (
        cli.main(["plan", "--recipe", "split-net", "--devices", "1", "--hardware", "h100-sxm"]) == 0
    )
    head = capsys.readouterr().out.splitlines()[0]
    assert "precision 32, batch" in head and "activation checkpointing none" in head, head


def test_check_says_why_a_short_run_has_no_memory_figure(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A run of fewer than 10 steps was "not measured by the run", with no word that the
    ledger writes its memory line as a window closes (steps 10, 20 and every K)."""
    hw = str(cpu_hardware_file(tmp_path / "cpu.toml"))
    for every, first in ((50, 10), (4, 4)):
        run = _ledger_run(tmp_path / f"run{every}", steps=3, memory=False, every=every)
        assert cli.main(["plan", "--check", str(run), "--hardware", hw]) == 0
        line = capsys.readouterr().out.splitlines()[-1]
        assert "not measured by the run: its ledger records memory as a window closes" in line
        assert f"every {every} (--ledger-every)" in line and "last start trained 3 step(s)" in line
        assert line.endswith(f"Fix: train at least {first} steps in one start"), line


def test_check_of_a_file_names_the_run_it_is_in(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--check RUN/config.json` said "expected RUN/config.json/config.json"."""
    run = _ledger_run(tmp_path / "run")
    for inside in (run / "config.json", run / "observe" / "rank0.jsonl", run / "observe"):
        code, err = _plan(capsys, "--check", str(inside), "--hardware", "h100-sxm")
        assert code == 2 and err.count("scaletrain: error:") == 1, err
        assert f"is a {'file' if inside.is_file() else 'directory'} inside the run {run}" in err
        assert f"Fix: --check {run}." in err and "config.json/config.json" not in err, err
    monkeypatch.chdir(run)  # the run here: named by its path, not "."
    here = Path.cwd()
    code, err = _plan(capsys, "--check", "config.json", "--hardware", "h100-sxm")
    assert code == 2 and f"inside the run {here}, not a run" in err and f"--check {here}." in err
    # A file in no run.
    code, err = _plan(capsys, "--check", str(cpu_hardware_file(tmp_path / "cpu.toml")))
    assert code == 2 and "is a file, not a finished run" in err, err


def test_check_of_a_run_of_only_its_warm_up_says_no_step_was_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run of `--max-steps 1` has only its warm-up step, which the run's own summary
    leaves out: --check compared the plan with it ("4.0 ms predicted, 2280.5 ms
    measured (-99.8%)")."""
    hw = str(cpu_hardware_file(tmp_path / "cpu.toml"))
    code, err = _plan(capsys, "--check", str(_ledger_run(tmp_path / "one", steps=1)),
                      "--hardware", hw)  # fmt: skip
    assert code == 2 and err.count("scaletrain: error:") == 1, err
    assert "the run's ledger counts no step of its last start (the layout its" in err, err
    assert "Fix: a start of at least 2 steps (--max-steps)" in err, err
    assert cli.main(["plan", "--check", str(_ledger_run(tmp_path / "two", steps=2)),
                     "--hardware", hw]) == 0  # fmt: skip


def test_check_of_a_run_whose_ledger_wrote_no_file_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run killed before its ledger's first line: its observe/ is empty, and --check
    ended in a FileNotFoundError's traceback."""
    (tmp_path / "run" / "observe").mkdir(parents=True)
    (tmp_path / "run" / "config.json").write_text('{"recipe": "gpt", "batch_size": 8}')
    code = cli.main(["plan", "--check", str(tmp_path / "run"), "--hardware", "h100-sxm"])
    err = capsys.readouterr().err
    assert code == 2 and "the run's ledger (RUN/observe/) holds no step. Fix:" in err, err


@pytest.mark.parametrize("strategy", ["dp", "model-parallel"])
def test_check_of_a_one_process_run_over_several_devices_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, strategy: str
) -> None:
    """A run of --strategy dp or model-parallel (one process over its devices) was
    checked against `ddp dp=1 (the run's layout)`: one device, which it was not."""
    hw = str(cpu_hardware_file(tmp_path / "cpu.toml"))
    run = _ledger_run(tmp_path / "run", strategy=strategy)
    code, err = _plan(capsys, "--check", str(run), "--hardware", hw)
    assert code == 2 and err.count("scaletrain: error:") == 1, err
    assert f"the run trained with --strategy {strategy} (" in err
    assert "a plan's rows are one process per device: none is that run's layout" in err


def test_a_long_profile_is_announced_once_on_stderr(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`scaletrain plan --recipe llama-8b --float8 --compile` printed nothing for over
    three minutes (the fake step of 8B parameters): a model that large is announced
    before its profile, once, on stderr; the table alone goes to stdout, and a profile
    kept from an earlier plan is not announced."""
    import scaletrain.planner.api as api

    monkeypatch.setattr(api, "LONG_PROFILE", 1)  # every model is large here
    monkeypatch.setattr(api, "_PROFILES", type(api._PROFILES)())
    args = ["plan", "--recipe", "gpt", "--devices", "4", "--hardware", "h100-sxm",
            "--precision", "bf16-mixed"]  # fmt: skip
    assert cli.main(args) == 0  # two profiles (sharded FSDP's and the others')
    out, err = capsys.readouterr()
    assert err.count("scaletrain plan: profiling gpt (") == 1, err
    assert "a fake forward, backward and optimizer step, a few minutes on a CPU" in err
    assert "profiling" not in out
    assert cli.main(args) == 0
    assert "profiling" not in capsys.readouterr().err  # kept: nothing to wait for


def test_check_measures_the_last_start_whose_layout_it_plans(tmp_path: Path) -> None:
    """A run of 2 ranks resumed on 1: --check plans the 1-rank layout (its config.json's)
    but measured the median over both starts' steps, rank 1's included."""
    import json

    from scaletrain.observe.metrics.phases import PHASES
    from scaletrain.planner.check import measured

    def step(s: int, wall: float, warm: bool = False) -> dict[str, object]:
        return {"kind": "step", "step": s, "t": float(s), "wall": wall,
                "p": [0.0] * len(PHASES), "flags": ["warmup"] if warm else []}  # fmt: skip

    run = tmp_path / "run"
    (run / "observe").mkdir(parents=True)
    first = [{"kind": "run", "world_size": 2, "unix": 100.0, "start_step": 0}]
    first += [step(s, 0.01, s == 1) for s in range(1, 11)]
    later = [{"kind": "run", "world_size": 1, "unix": 200.0, "start_step": 10}]
    later += [step(s, 0.03, s == 11) for s in range(11, 18)]
    for rank, lines in ((0, first + later), (1, first)):
        text = "".join(json.dumps(x) + "\n" for x in lines)
        (run / "observe" / f"rank{rank}.jsonl").write_text(text)
    seconds, _, _ = measured(run)
    assert seconds == pytest.approx(0.03)  # the median over both starts was 0.01
