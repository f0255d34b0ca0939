""".ci/stages.sh, CI's stage timer, on a clock of the test's own (CI_CLOCK): each stage's time and
the running total as it ends, the table at the end, a loud warning past the budget (CI goes on),
a failing stage ends CI with nothing run after it. .ci/run itself is not run here (it installs several
torch releases); the test checks that every make command in it is a timed stage."""

import os
import re
import subprocess

from harness import ROOT

STAGES = os.path.join(ROOT, ".ci", "stages.sh")


def _ci(tmp_path, script: str, budget: int | None = None) -> tuple[int, str]:
    """Runs `script` after sourcing stages.sh; `advance N` moves the clock N seconds on."""
    now = tmp_path / "now"
    now.write_text("1000\n")
    env = dict(os.environ, CI_CLOCK=f"cat {now}")
    if budget is not None:
        env["CI_BUDGET_S"] = str(budget)
    prog = (f"set -euo pipefail\nadvance() {{ echo $(( $(cat {now}) + $1 )) > {now}; }}\n"
            f"source {STAGES}\n{script}\n")
    p = subprocess.run(["bash", "-c", prog], env=env, capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout + p.stderr


def test_each_stage_and_the_total_are_printed(tmp_path):
    rc, out = _ci(tmp_path, 'ci_stage "install" advance 90\nci_stage "tests" advance 1500\nadvance 5\nci_summary')
    assert rc == 0, out
    assert "CI: install took 1:30 (total 1:30)" in out, out
    assert "CI: tests took 25:00 (total 26:30)" in out, out
    table = out[out.index("CI: stage times"):]
    assert re.search(r"^  install +1:30$", table, re.M) and re.search(r"^  tests +25:00$", table, re.M), out
    assert re.search(r"^  total +26:35 \(budget 45:00\)$", table, re.M), out
    assert "CI: finished in 26:35" in out, out


def test_past_the_budget_ci_warns_and_goes_on(tmp_path):
    rc, out = _ci(tmp_path, 'ci_stage "build" advance 2000\nci_stage "tests" advance 800\n'
                  'ci_stage "older torch" advance 10\nci_summary')
    assert rc == 0, out
    assert "CI: WARNING: OVER BUDGET: 46:40 is over the budget of 45:00" in out, out
    assert re.search(r"^  tests +13:20$", out, re.M), out  # the table names where the time went
    assert "CI: older torch took 0:10" in out and "CI: finished in 46:50" in out, out


def test_the_budget_is_checked_at_the_end_too(tmp_path):
    rc, out = _ci(tmp_path, 'ci_stage "tests" advance 50\nadvance 100\nci_summary', budget=120)
    assert rc == 0 and "CI: WARNING: OVER BUDGET: 2:30 is over the budget of 2:00 (CI_BUDGET_S=120)" in out, out


def test_a_failing_stage_ends_ci_with_its_status_and_the_table(tmp_path):
    rc, out = _ci(tmp_path, 'ci_stage "setup" advance 60\nbroken() { advance 7; return 3; }\n'
                  'ci_stage "tests" broken\nci_stage "later" advance 1\nci_summary')
    assert rc == 3, out
    assert "CI: tests took 0:07 (total 1:07)" in out and "CI: FAILED: tests exited with status 3" in out, out
    assert re.search(r"^  tests +0:07$", out, re.M) and "later" not in out, out


def test_every_make_command_of_ci_is_a_timed_stage():
    text = open(os.path.join(ROOT, ".ci", "run")).read()
    assert "source .ci/stages.sh" in text and text.rstrip().endswith("ci_summary"), text
    lines = [ln.split(" #")[0].strip() for ln in text.splitlines() if not ln.strip().startswith("#")]
    makes = [ln for ln in lines if re.search(r"\bmake\b", ln)]
    assert makes, "no make command in .ci/run"
    untimed = [ln for ln in makes if not ln.startswith("ci_stage ")]
    assert not untimed, f"make commands outside ci_stage: {untimed}"
    # each torch of CI is a stage (a setup and a test stage apiece)
    assert len(re.findall(r'^stage "torch [^"]+" ', text, re.M)) >= 2, text
