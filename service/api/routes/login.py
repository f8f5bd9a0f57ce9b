"""Signing a browser in with a one-time link (service/db/browser_logins.py): a token asks for a
code; the page, opened at `/dashboard#login=CODE`, exchanges it for a session of its own."""

from __future__ import annotations

from datetime import timedelta

from fastapi import APIRouter, HTTPException, Request, status

from api_schemas import LoginCodeOut, LoginRequest, TokenOut
from service.api.audit import note
from service.api.deps import NEEDS_TOKEN, TokenHolder, SessionsEndWithRoute, SettingsDep, WriteSessionDep, refuse_a_guesser
from service.db.browser_logins import issue_login_code, redeem_login_code
from service.db.models import User

router = APIRouter(prefix="/v1", tags=["accounts"], route_class=SessionsEndWithRoute)


@router.post("/login-codes", response_model=LoginCodeOut, status_code=status.HTTP_201_CREATED, responses=NEEDS_TOKEN)
def new_login_code(request: Request, session: WriteSessionDep, user: TokenHolder, settings: SettingsDep) -> LoginCodeOut:
    """A one-time code that signs a browser in as the caller, for `login_code_seconds`."""
    code, expires_at = issue_login_code(session, session.get_one(User, user.id), timedelta(seconds=settings.login_code_seconds))
    note(request, detail="made a one-time login link")
    return LoginCodeOut(code=code, expires_at=expires_at, link=f"/dashboard#login={code}")


@router.post(
    "/login", response_model=TokenOut,
    responses={401: {"description": "Not a code, or used, or expired."}, 429: {"description": "Too many failed attempts from this address."}},
)
def login(body: LoginRequest, request: Request, session: WriteSessionDep, settings: SettingsDep) -> TokenOut:
    """A browser session's token for a one-time code; the code is used up. Wrong codes count as wrong
    tokens do, per client address."""
    signed_in = redeem_login_code(session, body.code, timedelta(hours=settings.browser_session_hours))
    if signed_in is None:
        refuse_a_guesser(request, guessed=True)
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "this login link was used already, has expired or is not one: `trainyard open` makes a new one")
    token, expires_at, request.state.caller = signed_in  # the audit trail's: whose browser signed in
    note(request, detail="signed a browser in")
    return TokenOut(token=token, expires_at=expires_at)
