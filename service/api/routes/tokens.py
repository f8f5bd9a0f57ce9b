from __future__ import annotations

from fastapi import APIRouter, Request

from api_schemas import TokenOut
from service.api.audit import note
from service.api.deps import NEEDS_TOKEN, TokenHolder, SessionsEndWithRoute, WriteSessionDep
from service.db.accounts import rotate_token
from service.db.models import User

router = APIRouter(prefix="/v1/token", tags=["accounts"], responses=NEEDS_TOKEN, route_class=SessionsEndWithRoute)


@router.post("/rotate", response_model=TokenOut)
def rotate(request: Request, session: WriteSessionDep, user: TokenHolder) -> TokenOut:
    """A new token for the caller; the one this request carried stops working at once. A token
    with a lifetime is replaced by one with the same lifetime from now."""
    token, expires_at = rotate_token(session, session.get_one(User, user.id))
    note(request, detail="rotated own token")
    return TokenOut(token=token, expires_at=expires_at)
