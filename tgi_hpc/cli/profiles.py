"""`tgi-hpc profiles [show NAME]`: the clusters tgi-hpc knows, and one profile fully merged."""
from __future__ import annotations

import click

from tgi_hpc.cli._app import App, DefaultGroup, with_app


@click.group(cls=DefaultGroup)
def profiles() -> None:
    """List the known profiles (and clusters), or show one with `profiles show NAME`."""


@profiles.command("list")
@with_app
def list_command(app: App) -> None:
    """List profiles: built-in local, shipped ones, and yours (NAME.yaml in the config folder it prints)."""
    from tgi_hpc.profiles.loader import detect_cluster, list_profiles, user_config_dir

    names, where = list_profiles(), str(user_config_dir())
    detected = detect_cluster()
    app.emit({"profiles": names, "detected": detected, "config_dir": where},
             "\n".join(names) + (f"\n(detected here: {'/'.join(filter(None, detected))})" if detected else "")
             + f"\n(your profiles and overrides: {where}/NAME.yaml)")


@profiles.command("show")
@click.argument("name", required=False)
@with_app
def show(app: App, name) -> None:
    """Print profile NAME (default: --cluster or the detected one) after every merge and override."""
    import yaml

    from tgi_hpc.profiles.loader import load_profile

    profile = load_profile(name or app.cluster_name, overrides=app.overrides)
    data = profile.model_dump(mode="json")
    app.emit(data, lambda: click.echo(yaml.safe_dump(data, sort_keys=False), nl=False))


@profiles.command("check")
@with_app
def check(app: App) -> None:
    """Check the shipped profiles against their citation list (profiles/citations/pages.yaml): every source
    is a listed page, every value a page states is the profile's, and no two clusters disagree with a page."""
    from tgi_hpc.errors import ProfileError
    from tgi_hpc.profiles.facts import check_profiles, read_citations, shipped_profiles

    merged, texts = shipped_profiles()
    pages = read_citations()
    problems = check_profiles(merged, pages, texts)
    if problems:
        raise ProfileError(f"{len(problems)} profile fact(s) do not hold:\n  " + "\n  ".join(problems))
    app.emit({"clusters": sorted(merged), "pages": len(pages), "problems": []},
             f"facts hold: {len(merged)} clusters against {len(pages)} cited pages")
