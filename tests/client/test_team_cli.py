"""`trainyard team`: an admin makes teams, sets quotas and members, and deletes an unused team; a
user sees them; bad input is a message, never a traceback. Against the real API served by uvicorn."""

from __future__ import annotations

from service.db.accounts import create_user
from service.db.session import session_factory
from tests.client.test_account_cli import run  # noqa: F401 (the fixture: `trainyard ARGS…` against the API and its database)


def test_an_admin_makes_teams_sets_quotas_and_members_and_deletes_an_unused_one(run, settings):
    with session_factory(settings.resolved_database_url)() as session:
        _, root = create_user(session, "root", is_admin=True)
        _, bea = create_user(session, "bea")
    admin = ("--token", root)

    code, _, err = run("team", "create", "vision", "cpu=4", "slurm/cuda=8", *admin)
    assert code == 2 and "no pool named 'slurm'" in err  # no pool described yet: a quota nobody could use
    code, out, err = run("team", "create", "vision", "cpu=4", *admin)
    assert code == 0 and out.splitlines()[1].split()[:3] == ["vision", "4", "cpu"], out
    assert run("team", "add", "vision", "bea", *admin)[0] == 0
    code, out, _ = run("team", "add", "vision", "bea", "--default", *admin)  # said again: still her default
    assert code == 0 and "bea*" in out
    code, out, _ = run("team", "quota", "vision", "cpu=2", *admin)
    assert code == 0 and out.splitlines()[1].split()[:3] == ["vision", "2", "cpu"]

    # Everyone sees the teams; only an admin changes them.
    code, out, _ = run("team", "ls", "--token", bea)
    assert code == 0 and "vision" in out and "bea*" in out
    code, _, err = run("team", "create", "nlp", "cpu=1", "--token", bea)
    assert code == 1 and err.startswith("error: ") and "403" in err

    # Bad input: a message naming what is wrong.
    for words, says in (
        (("team", "quota", "vision"), "the following arguments are required: KIND=SLOTS"),  # never a silent clear
        (("team", "create", "nlp", "gpu=4"), "give KIND=SLOTS, KIND one of cpu, cuda"),
        (("team", "create", "nlp", "cpu=1", "cpu=2"), "a kind of slots is given more than once"),
        (("team", "add", "vision", "nobody"), "no user named 'nobody'"),
        (("team", "remove", "nlp", "bea"), "404"),
    ):
        code, _, err = run(*words, *admin)
        assert code != 0 and says in err and "Traceback" not in err, (words, err)

    # A team no job ran under can be deleted.
    assert run("team", "remove", "vision", "bea", *admin)[0] == 0
    assert run("team", "delete", "vision", *admin) == (0, "team vision deleted\n", "")
    assert "vision" not in run("team", "ls", *admin)[1]
