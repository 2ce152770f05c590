"""One successor per service job, however many of the job's processes ask (watch and the SIGTERM trap),
and whatever happened to an earlier submitter (killed, its sbatch timed out, Slurm not answering)."""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import time

import pytest

from tgi_hpc.service.state import Replica, ServiceState, locked, read_state, state_path
from tgi_hpc.slurm import handover
from tgi_hpc.slurm.successor_intent import COMMENT, Intent


def _service(tmp_path) -> str:
    path = state_path(str(tmp_path), "svc")
    os.makedirs(os.path.dirname(path))
    script = tmp_path / "svc.sbatch"
    script.write_text("#!/bin/bash\n")
    with open(path, "w") as fh:
        fh.write(ServiceState("svc", handover=True, script=str(script),
                              jobs=[Replica("41", state="ready", started_at=1.0, ready_at=1.5, ends_at=2.0)]).to_json())
    return path


def _fake_slurm(tmp_path, monkeypatch) -> tuple:
    """sbatch that logs its argv, sleeps (a slow controller) and answers a new id; scontrol logs too."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    (bin_dir / "sbatch").write_text(f"""#!/bin/bash
echo "sbatch $*" >> {calls}
sleep 1
echo $((500 + $(grep -c '^sbatch' {calls})))
""")
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "scontrol $*" >> {calls}\n')
    for tool in ("sbatch", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return calls


def _as_watch(path: str, out: str) -> None:
    me = read_state(path).job("41")
    with open(out, "w") as fh:
        fh.write(str(handover.submit_successor(path, me, 0)))


def _as_term(path: str, out: str) -> None:
    handover.on_term(path, "41")
    with open(out, "w") as fh:
        fh.write("done")


def test_watch_and_the_sigterm_trap_racing_submit_one_successor(tmp_path, monkeypatch):
    path, calls = _service(tmp_path), _fake_slurm(tmp_path, monkeypatch)
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_as_watch, args=(path, str(tmp_path / "watch.out"))),
             ctx.Process(target=_as_term, args=(path, str(tmp_path / "term.out")))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    sbatches = [line for line in calls.read_text().splitlines() if line.startswith("sbatch")]
    assert len(sbatches) == 1, sbatches
    st = read_state(path)
    successors = [j for j in st.jobs if j.predecessor == "41"]
    assert [j.job_id for j in successors] == ["501"] and st.job("41").successor == "501"
    assert st.job("41").submitting == "" and (tmp_path / "watch.out").read_text() == "501"
    assert f"--comment={COMMENT}" in sbatches[0]


def test_a_second_attempt_returns_the_recorded_successor(tmp_path, monkeypatch):
    path, calls = _service(tmp_path), _fake_slurm(tmp_path, monkeypatch)
    me = read_state(path).job("41")
    first = handover.submit_successor(path, me, 0)
    assert handover.submit_successor(path, me, 0) == first == "501"
    assert [line.split()[0] for line in calls.read_text().splitlines()] == ["sbatch"]


class _Slurm:
    """`_run` for the in-process tests: squeue answers `squeue`; sbatch answers 77."""

    def __init__(self, squeue: subprocess.CompletedProcess | None = None):
        self.calls, self.squeue = [], squeue or subprocess.CompletedProcess([], 0, "", "")

    def __call__(self, argv, **kwargs):
        self.calls.append(argv)
        if argv[0] == "squeue":
            return self.squeue
        return subprocess.CompletedProcess(argv, 0, "77\n" if argv[0] == "sbatch" else "", "")


def _with_intent(path: str, intent: Intent | str) -> None:
    with locked(path) as st:
        st.job("41").submitting = str(intent)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_dead_submitters_job_that_slurm_has_is_adopted(tmp_path, monkeypatch):
    path = _service(tmp_path)
    dead = Intent("abc123", Intent.mine().host, _dead_pid(), time.time())
    _with_intent(path, dead)
    slurm = _Slurm(subprocess.CompletedProcess([], 0, f"60 (null)\n66 {COMMENT}abc123\n", ""))
    monkeypatch.setattr(handover, "_run", slurm)
    assert handover.submit_successor(path, read_state(path).job("41"), 0) == "66"
    assert [c[0] for c in slurm.calls] == ["squeue"]   # no second sbatch
    st = read_state(path)
    assert st.job("41").successor == "66" and st.job("66").predecessor == "41" and st.job("41").submitting == ""


def test_a_dead_submitter_whose_sbatch_never_got_through_is_replaced(tmp_path, monkeypatch):
    path = _service(tmp_path)
    _with_intent(path, Intent("abc123", Intent.mine().host, _dead_pid(), time.time()))
    slurm = _Slurm(subprocess.CompletedProcess([], 0, f"60 {COMMENT}other\n", ""))
    monkeypatch.setattr(handover, "_run", slurm)
    assert handover.submit_successor(path, read_state(path).job("41"), 0) == "77"
    assert [c[0] for c in slurm.calls] == ["squeue", "sbatch"]
    assert read_state(path).job("41").submitting == ""


def test_no_answer_from_slurm_about_a_stale_intent_submits_nothing(tmp_path, monkeypatch):
    path = _service(tmp_path)
    _with_intent(path, Intent("abc123", "another-node", 4242, time.time() - 3600))   # long overdue
    slurm = _Slurm(subprocess.CompletedProcess([], 1, "", "slurm_load_jobs error: Socket timed out"))
    monkeypatch.setattr(handover, "_run", slurm)
    assert handover.submit_successor(path, read_state(path).job("41"), 0) is None
    assert [c[0] for c in slurm.calls] == ["squeue"]


def test_a_failed_sbatch_makes_the_next_attempt_ask_slurm_first(tmp_path, monkeypatch):
    path = _service(tmp_path)
    monkeypatch.setattr(handover, "_run", lambda argv, **kw: subprocess.CompletedProcess(argv, 1, "", "timed out"))
    me = read_state(path).job("41")
    assert handover.submit_successor(path, me, 0) is None
    assert Intent.parse(read_state(path).job("41").submitting).pid == 0   # outcome unknown
    slurm = _Slurm(subprocess.CompletedProcess([], 0, "", ""))
    monkeypatch.setattr(handover, "_run", slurm)
    assert handover.submit_successor(path, me, 0) == "77"
    assert [c[0] for c in slurm.calls] == ["squeue", "sbatch"]


def test_a_live_submitter_elsewhere_is_waited_for(tmp_path, monkeypatch):
    path = _service(tmp_path)
    _with_intent(path, Intent("abc123", "another-node", 4242, time.time()))
    slurm = _Slurm()
    monkeypatch.setattr(handover, "_run", slurm)
    monkeypatch.setattr(handover, "INTENT_POLL_S", 0.05)

    def other_node_records(_seconds, real=time.sleep, state={"n": 0}):
        state["n"] += 1
        if state["n"] == 3:
            with locked(path) as st:
                st.jobs.append(Replica("90", generation=1, predecessor="41"))
                st.job("41").successor, st.job("41").submitting = "90", ""
        real(0.01)

    monkeypatch.setattr(handover.time, "sleep", other_node_records)
    assert handover.submit_successor(path, read_state(path).job("41"), 0) == "90"
    assert slurm.calls == []


@pytest.mark.parametrize("garbage", ["x; rm -rf ~", "a b c", "tok host notapid 1.0", "\n"])
def test_a_garbled_intent_is_no_intent(tmp_path, monkeypatch, garbage):
    path = _service(tmp_path)
    _with_intent(path, garbage)
    slurm = _Slurm()
    monkeypatch.setattr(handover, "_run", slurm)
    assert handover.submit_successor(path, read_state(path).job("41"), 0) == "77"
    assert [c[0] for c in slurm.calls] == ["sbatch"]


@pytest.mark.parametrize("value", [None, 42, ["tok", "host", "1", "2"], "tok host 1 nan-ish", "tok host 1 2 extra"])
def test_intents_read_from_a_hand_edited_file_are_checked(value):
    assert Intent.parse(value) is None
    intent = Intent.mine()
    assert Intent.parse(str(intent)) == Intent(intent.token, intent.host, intent.pid, round(intent.at, 3))
