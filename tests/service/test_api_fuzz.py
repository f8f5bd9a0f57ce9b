"""Schemathesis against the OpenAPI schema, with a token and without: no 5xx, every response as
documented (status codes, content types, bodies), on SQLite and the real PostgreSQL."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings as hypothesis_settings
from schemathesis.checks import positive_data_acceptance, unsupported_method

from service.api.main import create_app
from service.db.accounts import create_user
from service.db.jobs import create_job
from service.db.session import session_factory
from tests.helpers import job_spec

# Cross-field rules (fp16 needs cuda, warmup < max_steps, …) can't be said in JSON Schema, so a
# schema-valid body may rightly get 422; and Starlette's 405 lists only the first matching route's
# methods in Allow. Everything else schemathesis checks stays on.
EXCLUDED = [positive_data_acceptance, unsupported_method]
EXAMPLES_PER_ROUTE = 25
# Without a token a route answers 401 before it reads its input (the token is checked first), so
# a few examples a route show it; the routes open to all get their 25 in the run with a token.
EXAMPLES_WITHOUT_TOKEN = 5


@pytest.mark.parametrize("authorized", [True, False], ids=["authorized", "unauthorized"])
def test_no_request_gets_a_5xx_or_an_undocumented_response(settings, authorized):
    with session_factory(settings.resolved_database_url)() as session:
        user, token = create_user(session, "alice")
        create_job(session, user, job_spec())  # so job routes can also answer 200, for id 1
    headers = {"Authorization": f"Bearer {token}"} if authorized else {}
    # The user's token on the host routes is a wrong host token: past the failed-auth limit the check
    # that a route refuses a request without one would get 429 (tests/service/test_api.py has the limit).
    schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(settings.model_copy(update={"max_failed_auths_per_minute": 100_000})))

    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10
    for operation in operations:

        @hypothesis_settings(max_examples=EXAMPLES_PER_ROUTE if authorized else EXAMPLES_WITHOUT_TOKEN, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=operation.as_strategy())
        def fuzz(case):
            case.call_and_validate(headers=headers, excluded_checks=EXCLUDED)

        fuzz()
