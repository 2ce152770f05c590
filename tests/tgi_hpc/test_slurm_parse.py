import pytest

from tgi_hpc.errors import SlurmError
from tgi_hpc.slurm.commands import parse_sacct, parse_sbatch, parse_squeue
from tgi_hpc.slurm.ports import pick_port, port_for_job


@pytest.mark.parametrize("out,job_id", [("123\n", "123"), ("4567;mila\n", "4567"), ("Submitted\n89_3\n", "89_3")])
def test_parse_sbatch(out, job_id):
    assert parse_sbatch(out) == job_id


def test_parse_sbatch_garbage():
    with pytest.raises(SlurmError):
        parse_sbatch("sbatch: error: invalid partition")


def test_parse_squeue():
    out = "12|tgi-hpc-serve|PENDING|Resources|(null)|0:00|1:00:00|main\n13|tgi-hpc-serve|RUNNING|None|cn-g001|0:05|1:00:00|long\nbad line\n"
    jobs = parse_squeue(out)
    assert [(j.job_id, j.state, j.reason, j.node) for j in jobs] == [
        ("12", "PENDING", "Resources", ""), ("13", "RUNNING", "", "cn-g001")]


def test_parse_sacct_skips_steps_and_reads_cancel_by():
    out = ("JobID|JobName|State|NodeList|Elapsed|Timelimit|Partition\n"
           "12|tgi-hpc-serve|CANCELLED by 0|cn-g001|00:00:05|01:00:00|main\n"
           "12.batch|batch|CANCELLED|cn-g001|||\n"
           "14|tgi-hpc-serve|TIMEOUT|cn-g002|00:01:00|00:01:00|main\n")
    jobs = {j.job_id: j for j in parse_sacct(out)}
    assert set(jobs) == {"12", "14"}
    assert jobs["12"].state == "CANCELLED" and jobs["14"].state == "TIMEOUT"


@pytest.mark.parametrize("job_id,port", [("4148", 14148), ("1234567", 14567), ("7", 10007), ("20000", 10000), ("88_3", 10088)])
def test_port_rule(job_id, port):
    assert port_for_job(job_id) == port


def test_pick_port_steps_past_a_taken_port():
    import socket

    first = port_for_job("4321")
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", first))
        busy.listen()
        assert pick_port("4321") == first + 1
    assert pick_port("4321", exclude={first}) == first + 1
