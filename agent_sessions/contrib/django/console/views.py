"""The console's pages and actions, called by ``admin.SessionAdmin`` (or ``ApprovalAdmin``) inside
``admin_site.admin_view`` (a staff user, logged in; CSRF checked on every POST); each checks its own
permission before it reads or writes anything. Session ids travel in URLs quoted as the admin quotes
primary keys, so any id the library accepts has a page; templates autoescape all that the store holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib import messages  # type: ignore[import-untyped]
from django.contrib.admin.models import CHANGE, DELETION, LogEntry  # type: ignore[import-untyped]
from django.contrib.admin.utils import quote, unquote  # type: ignore[import-untyped]
from django.contrib.contenttypes.models import ContentType  # type: ignore[import-untyped]
from django.core.exceptions import PermissionDenied  # type: ignore[import-untyped]
from django.http import Http404, HttpResponseNotAllowed, HttpResponseRedirect  # type: ignore[import-untyped]
from django.template.response import TemplateResponse  # type: ignore[import-untyped]
from django.urls import reverse  # type: ignore[import-untyped]
from django.utils.http import url_has_allowed_host_and_scheme  # type: ignore[import-untyped]

import agent_sessions as agent
from agent_sessions import validate

from .. import options, store
from .. import views as app_views
from ..models import Session
from . import actions, reading

LOG_PAGE = 100  # entries a page of the console's log shows


def _allowed(request: Any, action: str) -> None:
    if not request.user.has_perm(f"agent_sessions.{action}_session"):
        raise PermissionDenied(f"you may not {action} sessions")


def _lifecycle() -> agent.LifecycleStore:
    made = store()
    if not isinstance(made, agent.LifecycleStore):
        raise Http404(f"the console needs a store implementing agent_sessions.LifecycleStore; {made!r} does not")
    return made


def _session_id(object_id: str) -> str:
    session = str(unquote(object_id))
    try:
        return validate.session_id(session)
    except agent.ArgumentError as exc:
        raise Http404(str(exc)) from exc


def _url(model_admin: Any, name: str, *args: Any, model: str = "session") -> str:
    return str(reverse(f"admin:agent_sessions_{model}_{name}", args=args, current_app=model_admin.admin_site.name))


def session_url(model_admin: Any, session: str) -> str:
    return _url(model_admin, "change", quote(session))


def _context(model_admin: Any, request: Any, title: str, **more: Any) -> dict[str, Any]:
    may = {action: request.user.has_perm(f"agent_sessions.{action}_session")
           for action in ("steer", "cancel", "decide", "recover", "delete")}
    return {**model_admin.admin_site.each_context(request), "opts": model_admin.opts, "title": title,
            "may": may, "states": reading.STATES, "sessions_url": _url(model_admin, "changelist"),
            "log_url": _url(model_admin, "log"), "inbox_url": _url(model_admin, "changelist", model="approval"),
            **more}


# -- pages -------------------------------------------------------------------------------------------------------


def sessions(model_admin: Any, request: Any) -> Any:
    """Every session, newest activity first; filtered by state and spec, searched by id prefix and metadata."""
    _allowed(request, "view")
    found = reading.Listing([], None)
    search = request.GET.get("q", "")
    state = request.GET.get("state", "")
    query = reading.Query(state=state if state in reading.STATES else "", spec=request.GET.get("spec", ""))
    try:
        prefix, where = reading.parse_search(search)
        query = reading.Query(prefix, where, query.state, query.spec)
        found = reading.listing(_lifecycle(), query, request.GET.get("after") or None)
    except agent.ArgumentError as exc:
        messages.error(request, f"Cannot list that: {exc}")
    params = {k: v for k, v in (("q", search), ("state", query.state), ("spec", query.spec)) if v}
    return TemplateResponse(request, "agent_sessions/console/sessions.html", _context(
        model_admin, request, "Sessions", rows=[(r, session_url(model_admin, r.info.id)) for r in found.rows],
        listing=found, search=search, state=query.state, spec=query.spec, params=params,
        first_page=not request.GET.get("after")))


def session(model_admin: Any, request: Any, object_id: str) -> Any:
    _allowed(request, "view")
    sid = _session_id(object_id)
    made = _lifecycle()
    info = made.info(sid)
    if info is None:
        raise Http404("there is no such session (it was never written, or it was deleted)")
    before = request.GET.get("before")
    if before is not None and not (before.isascii() and before.isdigit() and len(before) < 19):
        raise Http404("before= must be a message index")
    seen = reading.look(made, info)
    page = reading.transcript(made, sid, None if before is None else int(before), info.messages)
    events, newest = reading.newest_events(made, sid)
    kind = ContentType.objects.get_for_model(Session, for_concrete_model=False)
    history = (LogEntry.objects.filter(content_type=kind, object_id=sid).select_related("user")
               .order_by("-action_time")[:20])
    url = session_url(model_admin, sid)
    return TemplateResponse(request, "agent_sessions/console/session.html", _context(
        model_admin, request, f"Session {sid}", session=seen, transcript=page, url=url,
        events=[(e, reading.event_line(e.kind, e.data)) for e in events], newest=newest,
        history=history,
        resolve=options()["RESOLVE"] is not None,
        events_url=_url(model_admin, "events", quote(sid)),
        action_urls={name: _url(model_admin, name, quote(sid)) for name in ACTIONS}))


def to_session(model_admin: Any, request: Any, object_id: str) -> Any:
    """``.../session/<id>/``: the session's page, as the admin's own ``<id>/`` leads to its change page."""
    return HttpResponseRedirect(_url(model_admin, "change", object_id))


def events(model_admin: Any, request: Any, object_id: str) -> Any:
    """The session's event log as server-sent events (the app's ``views.events``) behind the admin's login."""
    _allowed(request, "view")
    return app_views.events(request, _session_id(object_id))


def inbox(model_admin: Any, request: Any) -> Any:
    _allowed(request, "view")
    found = reading.inbox(_lifecycle(), request.GET.get("after") or None)
    return TemplateResponse(request, "agent_sessions/console/approvals.html", _context(
        model_admin, request, "Approvals waiting", inbox=found, first_page=not request.GET.get("after"),
        calls=[(a, session_url(model_admin, a.session), _url(model_admin, "approve", quote(a.session)),
                _url(model_admin, "deny", quote(a.session))) for a in found.calls]))


def log(model_admin: Any, request: Any) -> Any:
    """What operators did to sessions from the console, newest first (``before=<entry id>`` pages back)."""
    _allowed(request, "view")
    kind = ContentType.objects.get_for_model(Session, for_concrete_model=False)
    entries = LogEntry.objects.filter(content_type=kind).select_related("user").order_by("-pk")
    before = request.GET.get("before", "")
    if before.isascii() and before.isdigit() and len(before) < 19:
        entries = entries.filter(pk__lt=int(before))
    shown = list(entries[:LOG_PAGE + 1])
    return TemplateResponse(request, "agent_sessions/console/log.html", _context(
        model_admin, request, "What operators did",
        entries=[(e, session_url(model_admin, e.object_id)) for e in shown[:LOG_PAGE]],
        older=shown[LOG_PAGE - 1].pk if len(shown) > LOG_PAGE else None))


# -- actions: each a POST, behind its own permission, logged --------------------------------------------------------


def _act(permission: str, act: Callable[[Any, agent.Store, str], str], flag: int = CHANGE,
         ) -> Callable[..., Any]:
    """A view doing ``act`` (the request's POST, the store, the session id -> what the page says): POST
    only, ``permission`` checked first, a success recorded in the admin's log."""
    def view(model_admin: Any, request: Any, object_id: str) -> Any:
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        _allowed(request, permission)
        sid = _session_id(object_id)
        try:
            said = act(request.POST, store(), sid)
        except actions.Refused as exc:
            messages.error(request, str(exc))
        else:
            actions.record(request.user, sid, said, flag)
            messages.success(request, said)
            if flag == DELETION:
                return HttpResponseRedirect(_url(model_admin, "changelist"))
        back = request.POST.get("next", "")
        if back and url_has_allowed_host_and_scheme(back, allowed_hosts={request.get_host()},
                                                    require_https=request.is_secure()):
            return HttpResponseRedirect(back)
        return HttpResponseRedirect(session_url(model_admin, sid))
    return view


ACTIONS: dict[str, Callable[..., Any]] = {
    "steer": _act("steer", lambda post, made, sid: actions.steer(made, sid, post.get("text", ""))),
    "cancel": _act("cancel", lambda post, made, sid: actions.cancel(made, sid)),
    "approve": _act("decide", lambda post, made, sid: actions.decide(
        made, sid, post.get("call_id", ""), True, post.get("reason", ""))),
    "deny": _act("decide", lambda post, made, sid: actions.decide(
        made, sid, post.get("call_id", ""), False, post.get("reason", ""))),
    "recover": _act("recover", lambda post, made, sid: actions.recover(made, sid)),
    "delete": _act("delete", lambda post, made, sid: actions.delete(made, sid, post.get("force") == "on"),
                   DELETION),
}
"""The actions, by the last part of their URL (``.../session/<id>/steer/``)."""
