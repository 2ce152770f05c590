"""The facts check: every cited page is in the one citation list, every value a page states holds, and no two
clusters disagree with the same page (tgi_hpc/profiles/facts.py, `tgi-hpc profiles check`)."""
from __future__ import annotations

import copy

import pytest

from tgi_hpc.cli import main
from tgi_hpc.errors import ProfileError
from tgi_hpc.profiles import facts
from tgi_hpc.remote.ssh_config import CLUSTERS

QUICKSTART = "https://docs.alliancecan.ca/wiki/Trillium_Quickstart"


@pytest.fixture(scope="module")
def shipped():
    merged, texts = facts.shipped_profiles()
    return merged, texts, facts.read_citations()


def test_the_shipped_profiles_hold_against_their_pages(shipped):
    merged, texts, pages = shipped
    assert facts.check_profiles(merged, pages, texts) == []
    assert {"fir", "nibi", "rorqual", "narval", "trillium", "rocky", "tamia", "killarney", "vulcan", "mila"} <= set(merged)


def test_the_ssh_config_login_pages_are_in_the_list(shipped):
    _, _, pages = shipped
    for cluster, spec in CLUSTERS.items():
        assert facts.check_url(spec.source, pages, f"ssh_config {cluster}") == []


def test_the_list_states_the_facts_issue_27_names(shipped):
    _, _, pages = shipped
    states = {url: entry.get("states") or {} for url, entry in pages.items()}
    assert states[QUICKSTART]["trillium"]["multinode.max_nodes"] == 5
    assert states["https://docs.alliancecan.ca/wiki/Running_jobs"]["nibi"]["rules.time.min"] == "1:00:00"
    assert states["https://docs.alliancecan.ca/wiki/Using_GPUs_with_Slurm"]["killarney"]["slurm.gpu_types"] == ["l40s", "h100"]
    assert states["https://docs.alliancecan.ca/wiki/Rocky"]["rocky"]["slurm.gpu_memory_gb"] == {"h200": 141}


@pytest.mark.parametrize("url", [
    "https://docs.alliancecan.ca/wiki/Trillium_Quickstart_v2",
    "https://docs.alliancecan.ca/wiki/Trillium_Quickstart#No_such_section",
    "https://docs.alliancecan.ca/wiki/Nibi/../Fir",
    "https://docs.mila.quebec/technical_reference/clusters/mila/partitions",   # no trailing slash: another page
    "http://docs.alliancecan.ca/wiki/Fir",
    "$(touch /tmp/pwned)",
    "",
])
def test_a_source_outside_the_list_is_a_problem(shipped, url):
    merged, _, pages = shipped
    broken = copy.deepcopy(merged)
    broken["trillium"]["rules"]["time"]["source"] = url
    problems = facts.check_profiles(broken, pages)
    assert any(p.startswith("trillium: rules.time") and "cites" in p for p in problems), problems


def test_a_comment_url_outside_the_list_is_a_problem(shipped):
    merged, _, pages = shipped
    text = "# fine: https://docs.alliancecan.ca/wiki/Fir#Whatever\n# https://docs.alliancecan.ca/wiki/Made_up_page\nx: 1\n"
    problems = facts.check_profiles(merged, pages, {"p.yaml": text})
    assert problems == ["p.yaml:2: cites https://docs.alliancecan.ca/wiki/Made_up_page, which is not in the citation "
                        "list (pages.yaml)"]


@pytest.mark.parametrize("cluster, path, value", [
    ("trillium", ("multinode", "max_nodes"), 25),
    ("trillium", ("rules", "whole_nodes", "gpus_per_node", "b200"), 4),
    ("trillium", ("rules", "whole_nodes", "partial"), [1, 2]),
    ("nibi", ("rules", "time", "min"), None),
    ("rocky", ("slurm", "gpu_memory_gb", "h200"), 140),
    ("killarney", ("slurm", "gpu_types"), []),
    ("narval", ("rules", "mig", "max_instances"), 2),
])
def test_a_value_that_differs_from_its_page_is_a_problem(shipped, cluster, path, value):
    merged, _, pages = shipped
    broken = copy.deepcopy(merged)
    target = broken[cluster]
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    problems = facts.check_profiles(broken, pages)
    assert any(p.startswith(f"{cluster}: {'.'.join(path[:2])}") and "states" in p for p in problems), problems


def test_two_clusters_that_disagree_with_the_same_page_are_a_problem(shipped):
    merged, _, pages = shipped
    broken = copy.deepcopy(merged)
    broken["fir"]["rules"]["mig"]["max_instances"] = 2        # fir's MIG rule now differs from nibi's, same page
    problems = facts.check_profiles(broken, pages)
    assert any("clusters disagree on rules.mig" in p and "fir:" in p and "nibi:" in p for p in problems), problems


def test_a_page_that_states_facts_for_an_unknown_cluster_is_a_problem(shipped):
    merged, _, pages = shipped
    pages = {**pages, QUICKSTART: {**pages[QUICKSTART], "states": {"niagara": {"rules.time.max": "24:00:00"}}}}
    assert any("'niagara', which is not a shipped cluster" in p for p in facts.check_profiles(merged, pages))


def test_a_malformed_citation_list_is_refused(tmp_path):
    path = tmp_path / "pages.yaml"
    path.write_text("pages: [a, b]\n")
    with pytest.raises(ProfileError, match="expected `pages:`"):
        facts.read_citations(path)


def test_profiles_check_command_passes_and_fails_with_the_problems(capsys, monkeypatch):
    assert main(["profiles", "check"]) == 0
    assert "facts hold" in capsys.readouterr().out
    real = facts.read_citations()
    monkeypatch.setattr(facts, "read_citations", lambda path=None: {k: v for k, v in real.items() if k != QUICKSTART})
    assert main(["profiles", "check"]) == ProfileError.exit_code
    err = capsys.readouterr().err
    assert "do not hold" in err and QUICKSTART in err
