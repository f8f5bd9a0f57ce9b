from __future__ import annotations

from fastapi import APIRouter, Response

from service.api import prometheus
from service.api.deps import SessionDep, SessionsEndWithRoute, SettingsDep
from service.db.models import utcnow

router = APIRouter(tags=["monitoring"], route_class=SessionsEndWithRoute)


@router.get("/metrics", response_class=Response, responses={200: {"content": {prometheus.CONTENT_TYPE_LATEST: {}}}})
def metrics(session: SessionDep, settings: SettingsDep) -> Response:
    """Prometheus scrape target. Unauthenticated, as Prometheus expects; it exposes counts and host names only."""
    return Response(prometheus.scrape(session, settings, utcnow()), media_type=prometheus.CONTENT_TYPE_LATEST)
