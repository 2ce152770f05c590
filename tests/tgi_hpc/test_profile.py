"""Profiles: shipped files validate, merge order, errors that name file and key, detection, catalog."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tgi_hpc.errors import ProfileError
from tgi_hpc.profiles.loader import (
    detect_cluster,
    list_profiles,
    load_profile,
    profile_dirs,
    require_account,
    resources_for,
    user_config_dir,
)
from tgi_hpc.profiles.schema import Profile

SHIPPED = {p.stem: p for d in profile_dirs() for p in d.glob("*.yaml")}
DRAC_CLUSTERS = ["fir", "nibi", "rorqual", "narval", "trillium"]
PAICE_CLUSTERS = ["tamia", "killarney", "vulcan"]
RETIRED = {"cedar": "fir", "graham": "nibi", "beluga": "rorqual", "béluga": "rorqual", "niagara": "trillium"}

MINIMAL = """\
name: tiny
paths: {scratch: /s, models: /s/m, releases: /s/r, jobs: /s/j}
network: {compute_nodes_internet: true, download_on: job, compile_on: job}
"""


@pytest.fixture
def env(tmp_path):
    """An environment with its own (empty) user config dir and no cluster variables."""
    config = tmp_path / "config"
    config.mkdir()
    return {"TGI_HPC_CONFIG_DIR": str(config)}


def user_file(env, name: str, text: str) -> Path:
    path = Path(env["TGI_HPC_CONFIG_DIR"]) / f"{name}.yaml"
    path.write_text(text)
    return path


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(ProfileError) as info:
        fn(*args, **kwargs)
    return str(info.value)


# --- shipped profiles ------------------------------------------------------------------------

def test_both_cluster_profiles_ship():
    assert {"mila", "computecanada"} <= set(SHIPPED)
    assert list_profiles()[:1] == ["local"] and {"mila", "computecanada"} <= set(list_profiles())


@pytest.mark.parametrize("name", ["local", "mila", "computecanada", "paice", *DRAC_CLUSTERS, *PAICE_CLUSTERS])
def test_every_profile_and_cluster_validates(name, env):
    profile = load_profile(name, env=env)
    assert isinstance(profile, Profile)
    if name in DRAC_CLUSTERS + PAICE_CLUSTERS:
        assert (profile.name, profile.cluster) == ("computecanada" if name in DRAC_CLUSTERS else "paice", name)
        assert profile.login_host
    if profile.slurm is None:
        return
    # Every GPU type a default or catalog entry asks for is one the cluster documents.
    named = [r.gpu_type for r in profile.slurm.defaults.values()]
    named += [e.resources.gpu_type for e in profile.catalog]
    assert {t for t in named if t} <= set(profile.slurm.gpu_types)
    paths = profile.paths
    for path in (paths.scratch, paths.models, paths.jobs, *profile.environment.env.values()):
        assert "$HOME" not in path and "~" not in path      # caches and job output never in $HOME
    if profile.name in ("computecanada", "paice"):
        # The Alliance Python page: no virtualenv under $SCRATCH ("may get partially deleted").
        assert "$SCRATCH" not in paths.releases and paths.releases.startswith("$HOME/")


def test_drac_clusters_differ_where_the_docs_say_so(env):
    assert load_profile("narval", env=env).slurm.gpu_types[0] == "a100"
    assert load_profile("fir", env=env).network.compute_nodes_internet is True
    rorqual = load_profile("rorqual", env=env)
    assert rorqual.network.compute_nodes_internet is False
    assert rorqual.environment.env["HF_HUB_OFFLINE"] == "1"
    assert "HF_HUB_OFFLINE" not in load_profile("nibi", env=env).environment.env
    trillium = resources_for(load_profile("trillium", env=env), "serve", 8, None)
    assert (trillium.gpus, trillium.gpu_type, trillium.mem) == (1, None, None)   # no --mem on Trillium


def test_computecanada_shows_without_an_account(env):
    profile = load_profile("computecanada", env=env)
    assert profile.slurm.account_required and profile.slurm.account is None


URL = "https://docs."
WINDOW = 4   # a fact's citation sits on its line or at most this many lines above


def _fact_lines(text: str):
    for number, line in enumerate(text.splitlines(), 1):
        code = line.split(" #", 1)[0].strip()
        if not code or code.startswith("#"):
            continue
        key, sep, value = code.removeprefix("- ").partition(":")
        is_item = code.startswith("- ") and not sep
        if is_item or (sep and value.strip()):
            yield number


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_every_fact_cites_its_documentation_page(name):
    lines = SHIPPED[name].read_text().splitlines()
    facts = list(_fact_lines("\n".join(lines)))
    assert len(facts) > 40
    uncited = [f"{n}: {lines[n - 1].strip()}" for n in facts
               if not any(URL in line for line in lines[max(0, n - 1 - WINDOW):n])]
    assert not uncited, f"{SHIPPED[name]}: facts without a nearby {URL}... citation:\n" + "\n".join(uncited)


def test_citation_check_can_fail():
    text = "# https://docs.example/\na: 1\nb: 2\nc: 3\nd: 4\ne: 5\nf:\n  - x\n"
    assert list(_fact_lines(text)) == [2, 3, 4, 5, 6, 8]


# --- bad keys, bad YAML ----------------------------------------------------------------------

@pytest.mark.parametrize("key, shown", [
    ("acount", "slurm.acount"),
    ('"a\\nb"', "'a\\nb'"),                     # a real newline inside the key
    ("'$(touch /tmp/pwned)'", "'$(touch /tmp/pwned)'"),
    ("'x; rm -rf ~'", "'x; rm -rf ~'"),
    ("42", "42"),
    ("'é🙂'", "'é🙂'"),
])
def test_unknown_key_in_a_file_names_file_and_key(tmp_path, env, key, shown):
    path = tmp_path / "p.yaml"
    path.write_text(MINIMAL + f"slurm:\n  {key}: x\n")
    message = error_of(load_profile, path=path, env=env)
    assert str(path) in message and shown in message


def test_unknown_key_suggests_the_closest_valid_one(tmp_path, env):
    path = tmp_path / "p.yaml"
    path.write_text(MINIMAL + "slurm:\n  defaults:\n    serve: {tme: '1:00:00'}\n")
    message = error_of(load_profile, path=path, env=env)
    assert "slurm.defaults.serve.tme" in message and "did you mean slurm.defaults.serve.time" in message


def test_unknown_key_inside_a_cluster_is_reported_in_place(tmp_path, env):
    path = tmp_path / "p.yaml"
    path.write_text(MINIMAL + "slurm: {}\nclusters:\n  c1: {gpu_typs: [a]}\n")
    message = error_of(load_profile, path=path, env=env, cluster="c1")
    assert "clusters.c1.gpu_typs" in message and "gpu_types" in message


def test_wrong_type_names_key_and_value(tmp_path, env):
    path = tmp_path / "p.yaml"
    path.write_text(MINIMAL + "slurm: {defaults: {serve: {gpus: many}}}\n")
    message = error_of(load_profile, path=path, env=env)
    assert str(path) in message and "slurm.defaults.serve.gpus" in message and "'many'" in message


@pytest.mark.parametrize("text, line", [
    (MINIMAL + "slurm: [unclosed\n", 5),
    (MINIMAL + "network: {compute_nodes_internet: true}\n", 4),   # duplicate key
    (MINIMAL + "paths:\n\tscratch: /x\n", 5),                    # tab indentation
])
def test_yaml_errors_name_file_and_line(tmp_path, env, text, line):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    message = error_of(load_profile, path=path, env=env)
    assert f"{path}:{line}:" in message


def test_explicit_path_and_cluster(tmp_path, env):
    path = tmp_path / "custom"                        # no .yaml suffix: still a path
    path.write_text(MINIMAL + "clusters:\n  c1: {login_host: c1-login}\n")
    assert load_profile(path=path, env=env).login_host is None
    assert load_profile(path=path, cluster="c1", env=env).login_host == "c1-login"
    assert load_profile("computecanada", cluster="Narval", env=env).cluster == "narval"


def test_a_profile_must_be_a_mapping(tmp_path, env):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    assert "mapping" in error_of(load_profile, path=path, env=env)


def test_unknown_profile_suggests_a_name(env):
    message = error_of(load_profile, "milla", env=env)
    assert "'milla'" in message and "did you mean 'mila'" in message


# --- merge order -----------------------------------------------------------------------------

def test_set_overrides_parse_yaml_scalars_and_nest(env):
    profile = load_profile("mila", env=env, overrides=[
        "slurm.account=def-x", "slurm.defaults.serve.time=1:00:00", "slurm.defaults.serve.gpus=2",
        "environment.modules=[a, b]", "environment.env.MY_VAR=$SCRATCH/x"])
    serve = profile.slurm.defaults["serve"]
    assert profile.slurm.account == "def-x"
    assert (serve.time, serve.gpus, serve.partition) == ("1:00:00", 2, "main")   # the rest is kept
    assert profile.environment.modules == ["a", "b"]
    assert profile.environment.env["MY_VAR"] == "$SCRATCH/x"
    assert "HF_HOME" in profile.environment.env


@pytest.mark.parametrize("item, shown", [
    ("slurm.acount=def-x", "--set slurm.acount=def-x"),
    ("slurm.defaults.serve.gpu=2", "did you mean slurm.defaults.serve.gpus"),
    ("bogus.key=1", "unknown key bogus"),
    ("slurm.$(touch /tmp/pwned)=1", "'$(touch /tmp/pwned)'"),
])
def test_set_with_an_unknown_key_names_it(env, item, shown):
    assert shown in error_of(load_profile, "mila", env=env, overrides=[item])


@pytest.mark.parametrize("item", ["slurm.account", "=x", "slurm..account=x"])
def test_set_needs_key_equals_value(env, item):
    assert "KEY.PATH=VALUE" in error_of(load_profile, "mila", env=env, overrides=[item])


def test_user_file_merges_over_shipped_and_set_wins(env):
    user_file(env, "computecanada", "slurm:\n  account: def-file\n  defaults:\n    serve: {time: '3:00:00'}\n")
    profile = load_profile("narval", env=env)
    assert profile.slurm.account == "def-file"
    assert profile.slurm.defaults["serve"].time == "3:00:00"
    assert profile.slurm.defaults["serve"].gpu_type == "a100"       # cluster value kept below it
    assert load_profile("narval", env=env, overrides=["slurm.account=def-flag"]).slurm.account == "def-flag"


def test_slurm_times_stay_strings(env):
    user_file(env, "mila", "slurm:\n  defaults:\n    serve: {time: 1:30:00}\n    compile: {time: 2-00:00:00}\n")
    defaults = load_profile("mila", env=env, overrides=["slurm.defaults.download.time=0:45"]).slurm.defaults
    assert (defaults["serve"].time, defaults["compile"].time, defaults["download"].time) == (
        "1:30:00", "2-00:00:00", "0:45")


def test_user_file_can_edit_a_cluster(env):
    user_file(env, "computecanada", "clusters:\n  fir: {login_host: my-fir}\n")
    assert load_profile("fir", env=env).login_host == "my-fir"


def test_unknown_key_in_user_file_names_the_user_file(env):
    path = user_file(env, "mila", "slurm:\n  acount: def-x\n")
    message = error_of(load_profile, "mila", env=env)
    assert str(path) in message and "slurm.acount" in message and "slurm.account" in message


def test_user_only_profile_is_listed_and_loads(env):
    user_file(env, "tiny", MINIMAL)
    assert "tiny" in list_profiles(env)
    assert load_profile("tiny", env=env).paths.scratch == "/s"


def test_tgi_hpc_account_fills_the_account(env):
    env["TGI_HPC_ACCOUNT"] = "def-env"
    assert load_profile("rorqual", env=env).slurm.account == "def-env"
    assert load_profile("rorqual", env=env, overrides=["slurm.account=def-set"]).slurm.account == "def-set"
    assert load_profile("local", env=env).slurm is None                 # no Slurm, nothing to fill


def test_local_profile_uses_xdg_data_home(tmp_path, env):
    env["XDG_DATA_HOME"] = str(tmp_path / "data")
    profile = load_profile("local", env=env)
    assert profile.slurm is None and profile.network.compute_nodes_internet
    assert profile.paths.models == f"{tmp_path}/data/tgi-hpc/models"


def test_user_config_dir_honours_the_variable(tmp_path):
    assert user_config_dir({"TGI_HPC_CONFIG_DIR": str(tmp_path)}) == tmp_path
    assert user_config_dir({}).name == "tgi-hpc"


# --- account ---------------------------------------------------------------------------------

def test_require_account_says_how_to_set_it(env):
    message = error_of(require_account, load_profile("fir", env=env))
    assert "--set slurm.account=def-yourpi" in message
    assert "TGI_HPC_ACCOUNT" in message
    assert "computecanada.yaml" in message and "fir" in message


def test_require_account_passes_when_set_or_not_needed(env):
    assert require_account(load_profile("fir", env=env, overrides=["slurm.account=def-x"])) == "def-x"
    assert require_account(load_profile("mila", env=env)) is None
    assert require_account(load_profile("local", env=env)) is None


# --- clusters and detection ------------------------------------------------------------------

@pytest.mark.parametrize("name, instead", RETIRED.items())
def test_retired_clusters_say_what_replaced_them(env, name, instead):
    message = error_of(load_profile, name, env=env)
    assert "retired" in message and repr(instead) in message


def test_unknown_cluster_lists_the_known_ones(env):
    message = error_of(load_profile, "computecanada", cluster="helios", env=env)
    assert "'helios'" in message and "narval" in message


@pytest.mark.parametrize("env_vars, hostname, expected", [
    ({"CC_CLUSTER": "narval"}, "narval3.narval.calcul.quebec", ("computecanada", "narval")),
    ({"CC_CLUSTER": "rorqual"}, "", ("computecanada", "rorqual")),
    ({"CC_CLUSTER": "cedar"}, "", ("computecanada", "cedar")),
    ({}, "trig-login01", ("computecanada", "trillium")),
    ({}, "login-2.login.server.mila.quebec", ("mila", None)),
    ({}, "cn-l023.server.mila.quebec", ("mila", None)),
    ({"CC_CLUSTER": "computecanada"}, "laptop.local", None),   # CVMFS outside a cluster
    ({}, "laptop.local", None),
])
def test_detect_cluster(env_vars, hostname, expected):
    assert detect_cluster(env_vars, hostname) == expected


def test_load_profile_resolution_order(env, monkeypatch):
    import socket

    monkeypatch.setattr(socket, "getfqdn", lambda: "laptop.local")
    assert load_profile(env=env).name == "local"
    on_rorqual = load_profile(env={**env, "CC_CLUSTER": "rorqual"})
    assert (on_rorqual.name, on_rorqual.cluster) == ("computecanada", "rorqual")
    chosen = load_profile(env={**env, "CC_CLUSTER": "rorqual", "TGI_HPC_CLUSTER": "mila"})
    assert chosen.name == "mila"
    assert load_profile("computecanada", env={**env, "CC_CLUSTER": "fir"}).cluster == "fir"
    assert "retired" in error_of(load_profile, env={**env, "CC_CLUSTER": "graham"})


# --- resources -------------------------------------------------------------------------------

@pytest.mark.parametrize("name, size, gpus, gpu_type", [
    ("rorqual", 8, 1, "h100"), ("rorqual", 13, 1, "h100"), ("rorqual", 34, 2, "h100"),
    ("rorqual", 70, 4, "h100"), ("rorqual", 0.135, 1, "h100"),
    ("narval", 8, 1, "a100"), ("narval", 13, 2, "a100"), ("narval", 34, 4, "a100"),
    ("trillium", 34, 4, None),
    ("mila", 0.135, 1, "l40s"), ("mila", 8, 1, "l40s"), ("mila", 13, 1, "l40s"),
    ("mila", 34, 2, None), ("mila", 70, 4, None),
    ("tamia", 8, 4, "h100"), ("tamia", 70, 4, "h100"), ("killarney", 34, 4, "l40s"), ("killarney", 70, 4, "h100"),
    ("vulcan", 13, 1, "l40s"), ("rocky", 70, 2, "h200"),
])
def test_resources_for_picks_the_smallest_fitting_entry(env, name, size, gpus, gpu_type):
    resources = resources_for(load_profile(name, env=env), "serve", size, None)
    assert (resources.gpus, resources.gpu_type) == (gpus, gpu_type)
    if name == "mila" and size > 15:   # 80 GB A100s by feature: the docs name a100l for the DGX nodes only
        assert resources.constraint == "ampere&80gb"
    assert resources.time                                  # slurm.defaults.serve fills the rest


def test_resources_for_keeps_defaults_and_explicit_gpus(env):
    mila = load_profile("mila", env=env)
    assert resources_for(mila, "serve", 70, None).partition == "long"
    assert resources_for(mila, "serve", 8, 3).gpus == 3
    assert resources_for(mila, "download", 70, None).gpus == 0     # the catalog is for serve only
    assert resources_for(mila, "serve", None, None) == mila.slurm.defaults["serve"]
    assert resources_for(load_profile("local", env=env), "serve", 8, None).gpus is None


def test_resources_for_a_model_larger_than_the_catalog(env):
    narval = load_profile("narval", env=env)
    assert "--gpus" in error_of(resources_for, narval, "serve", 70, None)
    assert resources_for(narval, "serve", 70, 4).gpus == 4
    assert "405B" in error_of(resources_for, load_profile("mila", env=env), "serve", 405, None)


def test_shipped_yaml_is_plain_yaml():
    for path in SHIPPED.values():
        assert isinstance(yaml.safe_load(path.read_text()), dict)
        assert not re.search(r"^\t", path.read_text(), re.M)
