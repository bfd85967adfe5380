"""`mlx-dflash doctor`: each check on this machine, a kernel variant failing its check (the
report names it and the command exits 1), and the other failures it knows."""

import subprocess
import sys

from mlx_dflash import doctor, kernels


def test_on_this_machine_every_check_reports():
    findings = doctor.diagnose()
    checks = {f.check for f in findings}
    assert {"platform", "mlx", "metal", "kernels", "blas", "memory", "cache"} <= checks
    assert all(f.status in (doctor.OK, doctor.INFO, doctor.WARN, doctor.FAIL) for f in findings)
    kernels_found = [f for f in findings if f.check == "kernels"][0]
    assert kernels_found.status == doctor.OK and "variants run" in kernels_found.detail


def test_a_failing_kernel_variant_is_named_and_fails_the_report():
    def check(variant):
        return "compile error: simulated" if variant.step == "path_select" else None

    found = doctor.check_kernels(metal=True, check=check)
    assert found[0].status == doctor.FAIL
    assert "path_select float32" in found[0].detail and "simulated" in found[0].detail
    assert kernels.ENV_SWITCH in found[0].fix
    lines = []
    assert doctor.report(found, lines.append) == 1
    assert lines[-1].startswith("1 problem(s): kernels")
    assert doctor.check_kernels(metal=True, check=lambda v: None)[0].status == doctor.OK


def test_other_failures_say_what_to_do(tmp_path):
    low = doctor.check_memory(headroom=1 << 20)[0]
    assert low.status == doctor.WARN and low.fix
    blocked = tmp_path / "file"
    blocked.write_text("")
    cache = doctor.check_cache(blocked / "cache")[0]  # under a file: cannot be made
    assert cache.status == doctor.FAIL and "MLX_DFLASH_HOME" in cache.fix


def test_the_command_runs_and_exits_by_what_it_found(tmp_path):
    run = subprocess.run([sys.executable, "-m", "mlx_dflash.cli", "doctor"], capture_output=True,
                         text=True, timeout=300,
                         env={**__import__("os").environ, "MLX_DFLASH_HOME": str(tmp_path)})
    assert run.returncode in (0, 1), run.stderr[-2000:]
    assert "kernels:" in run.stdout and "blas:" in run.stdout
    failed = "FAIL" in run.stdout
    assert (run.returncode == 1) == failed


def test_a_pair_is_reported_with_its_pass_costs_and_the_schedulers_choice(tmp_path,
                                                                         monkeypatch):
    from tiny import make_drafter, make_target

    from mlx_dflash.drafters.base import LookupDrafts

    monkeypatch.setenv("MLX_DFLASH_HOME", str(tmp_path))
    model = make_target("qwen3", seed=2)
    found = doctor.check_pair(model, make_drafter(model, block_size=4), "tiny")
    assert [f.check for f in found] == ["pair"] * 3
    assert all("a verify of 2 tokens" in f.detail and "drafts" in f.detail for f in found)
    assert "nothing is drafted" in doctor.check_pair(model, None, "alone")[0].detail
    assert "lookup drafts only" in doctor.check_pair(model, LookupDrafts(), "lookups")[0].detail
