//! The web console (`docs/CONSOLE.md`): server-rendered HTML pages for operators, served on
//! `[gateway.console] listen` by the process that runs the gateway (the coordinator), behind
//! the gateway's credentials and TLS. No Node.js and no build step: the pages are written
//! here, and the one stylesheet and one script are embedded in the binary with `include_str!`
//! (`static/console.css`, `static/console.js`), so there is nothing to build or fetch, and the
//! Content-Security-Policy allows no inline script.
//!
//! Rooms: `html.rs` escaping, layout, error pages and security headers; `session.rs` browser
//! sessions and CSRF tokens; `agents.rs` the live agents; `tasks.rs` the task list, a task's
//! page, its events and cancel; `dlq.rs` the dead-letter queue; `tap.rs` live traffic;
//! `overview.rs` counters sampled into a ring and drawn as inline SVG.
//!
//! Who: a caller signs in at `/login` with an API key or a JWT (a session cookie), or sends
//! `Authorization: Bearer` / `X-API-Key` on each request (scripts). The scope route groups
//! `console` (every page and stream) and `console-admin` (cancel, replay, purge) decide what it
//! may do (without `[[gateway.scopes]]`, both). The console reads the bus and acts (cancels,
//! replays, purges) as its own internal agent, `chorus-console`, with the gateway process's
//! bus credentials; every action is logged with the identity of the caller who asked.
//!
//! Element ids and classes the browser tests use: `nav` (the nav bar), `identity`, `logout`;
//! login: `login` (form), `credential`; errors: `error`; overview: `overview`, `chart-kinds`,
//! `chart-refusals`, `chart-dlq`, `chart-tasks`; agents: table `agents` with rows
//! `data-agent="<id>"`; an agent: `manifest`, `refusals`; tasks: filter form `task-filter`,
//! table `tasks` with rows `data-task="<id>"`, `next-page`, `prev-page`; a task: `task-state`,
//! `task-progress`, `task-chunks`, `task-events`, `task-attempts`, `task-report`, `cancel`;
//! dead letters: filter form `dlq-filter`, table `dlq` with rows `data-id="<id>"`, `replay`
//! (a row's or a letter's replay button, class `replay` on rows), `replay-all`, `purge`,
//! `purge-confirm`, `dlq-envelope`, `notice`; live traffic: `tap-form`, `tap-log`, `tap-pause`,
//! `tap-dropped`, rows of class `tap-row`.

// A refusal here is the page to answer with (axum's `Response`), returned once per request:
// its size does not matter.
#![allow(clippy::result_large_err)]

mod agents;
mod dlq;
mod html;
mod overview;
mod session;
mod tap;
mod tasks;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use chorus_sdk::{Agent, AgentOptions, BrokerOptions};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::GatewayState;
use crate::auth::AuthError;
use crate::error::{Error, ErrorKind, Result};
use crate::scopes::{Grants, Route};
use html::Chrome;

/// The id of the console's own agent on the bus.
pub(crate) const CONSOLE_AGENT: &str = chorus_sdk::registry::CONSOLE_ID;

const CSS: &str = include_str!("static/console.css");
const JS: &str = include_str!("static/console.js");

/// What the console's routes share.
pub(crate) struct Console {
    gateway: Arc<GatewayState>,
    /// The console's own agent: discovery, tasks, the dead-letter stream, the tap.
    agent: Agent,
    sessions: session::Sessions,
    tls: bool,
    stop: CancellationToken,
    overview: overview::Samples,
    refusals: agents::Refusals,
    tap: tap::Counters,
    /// What people do here, in the audit stream, each action by who did it.
    audit: chorus_sdk::audit::AuditSink,
    /// The coordinator's key, its dead-letter replays are signed with (`Bus::replay_seed_file`).
    replayer: Option<Arc<chorus_sdk::security::Identity>>,
}

/// Who is asking, once authenticated.
pub(crate) struct Who {
    identity: String,
    grants: Option<Arc<Grants>>,
    /// The session's CSRF token, when the caller came with a session cookie.
    csrf: Option<String>,
}

impl Who {
    fn may(&self, route: Route) -> bool {
        self.grants.as_ref().is_none_or(|g| g.route(route))
    }

    /// Whether it may cancel, replay and purge (its pages show those buttons).
    pub(crate) fn admin(&self) -> bool {
        self.may(Route::ConsoleAdmin)
    }

    pub(crate) fn chrome(&self) -> Chrome<'_> {
        Chrome {
            identity: &self.identity,
            csrf: self.csrf.as_deref(),
        }
    }

    /// The hidden CSRF input of this caller's forms.
    pub(crate) fn csrf_input(&self) -> String {
        html::csrf_input(self.csrf.as_deref())
    }
}

/// How a request without credentials is answered: pages send the browser to `/login`, feeds
/// (server-sent events, fragments) answer 401.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wants {
    Page,
    Feed,
}

impl Console {
    /// The caller of `headers`, if it may use `route`: its credentials in headers, or its
    /// session cookie. Otherwise the answer to give: 303 to `/login` (a page without
    /// credentials), 401 (a feed, or credentials that do not check), 403 (a scope that does
    /// not grant the route).
    pub(crate) fn who(
        &self,
        headers: &HeaderMap,
        uri: &str,
        route: Route,
        wants: Wants,
    ) -> std::result::Result<Who, Response> {
        let direct =
            headers.contains_key("x-api-key") || headers.contains_key(header::AUTHORIZATION);
        let (caller, csrf) = if direct {
            match self.gateway.auth.authenticate(headers) {
                Ok(caller) => (caller, None),
                Err(e) => return Err(unauthorized(&e)),
            }
        } else {
            let session = session::cookie(headers, session::COOKIE)
                .and_then(|id| self.sessions.get(&id, Instant::now()).map(|s| (id, s)));
            let Some((id, session)) = session else {
                return Err(match wants {
                    Wants::Page => html::see_other(&format!("/login?next={}", html::url_part(uri))),
                    Wants::Feed => unauthorized(&AuthError::Missing),
                });
            };
            match self.gateway.auth.bearer(&session.credential) {
                Ok(caller) => (caller, Some(session.csrf)),
                Err(e) => {
                    // An expired token ends its session.
                    self.sessions.remove(&id);
                    return Err(match wants {
                        Wants::Page => html::see_other("/login?expired=1"),
                        Wants::Feed => unauthorized(&e),
                    });
                }
            }
        };
        let who = Who {
            grants: self.gateway.scopes.grants(&caller.scopes),
            identity: caller.identity,
            csrf,
        };
        if !who.may(Route::Console) || !who.may(route) {
            let names = who.grants.as_ref().map(|g| g.names()).unwrap_or_default();
            return Err(html::error(
                StatusCode::FORBIDDEN,
                Some(&who.chrome()),
                &format!(
                    "your scopes ({names}) do not grant the {} route group",
                    route.name()
                ),
            ));
        }
        Ok(who)
    }

    /// The caller of a form `POST`, as [`who`](Console::who) for `route`, and its form: a
    /// caller with a session must send the session's CSRF token (`csrf`), and a request with an
    /// `Origin` must come from the console's own; 403 otherwise.
    pub(crate) fn who_posts(
        &self,
        headers: &HeaderMap,
        body: &Bytes,
        route: Route,
    ) -> std::result::Result<(Who, HashMap<String, String>), Response> {
        let who = self.who(headers, "/", route, Wants::Page)?;
        if !self.same_origin(headers) {
            return Err(html::error(
                StatusCode::FORBIDDEN,
                Some(&who.chrome()),
                "the form was not sent from this console (Origin does not match)",
            ));
        }
        // An action counts against its identity's rate, as the gateway's requests do.
        if let Err(refused) = self.gateway.limits.admit(&who.identity) {
            crate::metrics::count_refusal("rate_limited");
            return Err(html::error(
                StatusCode::TOO_MANY_REQUESTS,
                Some(&who.chrome()),
                refused.reason(),
            ));
        }
        let form = form(body)
            .map_err(|e| html::error(StatusCode::BAD_REQUEST, Some(&who.chrome()), &e))?;
        if let Some(expected) = &who.csrf {
            let given = form.get("csrf").map(String::as_str).unwrap_or_default();
            if !session::same(given, expected) {
                return Err(html::error(
                    StatusCode::FORBIDDEN,
                    Some(&who.chrome()),
                    "the form's CSRF token is missing or wrong: reload the page and try again",
                ));
            }
        }
        Ok((who, form))
    }

    /// Records `who` doing `action` (on `target`) in the audit stream: `outcome` `ok`,
    /// `refused` or `failed`, with a `detail` when there is one.
    pub(crate) fn audit(
        &self,
        who: &Who,
        action: &str,
        target: Option<String>,
        outcome: &str,
        detail: Option<String>,
    ) {
        let mut record =
            chorus_sdk::audit::AuditRecord::new("console", who.identity.as_str(), action, outcome);
        if let Some(target) = target {
            record = record.target(target);
        }
        if let Some(detail) = detail {
            record = record.detail(detail);
        }
        self.audit.record(record);
    }

    /// Whether `headers`' `Origin`, if any, is this console's own (its scheme and `Host`).
    fn same_origin(&self, headers: &HeaderMap) -> bool {
        let Some(origin) = headers.get(header::ORIGIN) else {
            return true;
        };
        let host = headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or_default();
        let scheme = if self.tls { "https" } else { "http" };
        origin
            .to_str()
            .is_ok_and(|o| !host.is_empty() && o == format!("{scheme}://{host}"))
    }

    /// A 503 page for a bus that did not answer, the failure logged.
    pub(crate) fn bus_down(&self, who: &Who, what: &str, err: &dyn std::fmt::Display) -> Response {
        tracing::warn!(error = %err, "console: {what}");
        html::error(
            StatusCode::SERVICE_UNAVAILABLE,
            Some(&who.chrome()),
            &format!("the bus did not answer ({what}): try again in a moment"),
        )
    }
}

/// 401 with a plain message (the refusal's reason).
fn unauthorized(e: &AuthError) -> Response {
    (
        StatusCode::UNAUTHORIZED,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        format!("not signed in: {e}\n"),
    )
        .into_response()
}

/// The fields of a form body (`application/x-www-form-urlencoded`); a repeated field keeps its
/// last value.
pub(crate) fn form(body: &[u8]) -> std::result::Result<HashMap<String, String>, String> {
    serde_urlencoded::from_bytes::<Vec<(String, String)>>(body)
        .map(|pairs| pairs.into_iter().collect())
        .map_err(|e| format!("the form does not read: {e}"))
}

/// The fields of a query string.
pub(crate) fn query(raw: Option<&str>) -> std::result::Result<HashMap<String, String>, String> {
    form(raw.unwrap_or_default().as_bytes())
        .map_err(|_| "the query string does not read".to_owned())
}

/// The value of field `name` of a query string or a form, trimmed, if it is there and not empty.
pub(crate) fn given<'a>(q: &'a HashMap<String, String>, name: &str) -> Option<&'a str> {
    q.get(name).map(|v| v.trim()).filter(|v| !v.is_empty())
}

/// The `agent` filter of a query string or a form: none, a valid agent id, or a message saying
/// why it is not one.
pub(crate) fn agent_filter(
    q: &HashMap<String, String>,
) -> std::result::Result<Option<String>, String> {
    given(q, "agent")
        .map(|a| {
            chorus_sdk::subject::validate_token("agent", a)
                .map(|()| a.to_owned())
                .map_err(|e| format!("agent: {e}"))
        })
        .transpose()
}

/// Connects the console's own agent (no heartbeats, not listed in discovery).
async fn connect(bus: &crate::Bus) -> Result<Agent> {
    let subjects = chorus_sdk::Subjects::new(&bus.root)
        .map_err(Error::wrap(ErrorKind::Config, "invalid root"))?;
    let inbox_prefix = subjects
        .inbox_prefix(CONSOLE_AGENT)
        .map_err(Error::wrap(ErrorKind::Config, "console: identity"))?;
    let broker = bus
        .security
        .apply(
            BrokerOptions::new([bus.servers.as_str()])
                .name("chorus-console")
                .inbox_prefix(inbox_prefix),
        )
        .map_err(Error::wrap(ErrorKind::Config, "console"))?;
    AgentOptions::new(CONSOLE_AGENT)
        .root(bus.root.clone())
        .broker(broker)
        .heartbeat_interval(Duration::ZERO)
        .service_discovery(false)
        .shutdown_timeout(bus.shutdown_timeout)
        .connect()
        .await
        .map_err(Error::wrap(
            ErrorKind::Connect,
            "console: cannot reach NATS",
        ))
}

/// Starts the console on `listen`: its agent, its samplers and its listener, owned by
/// `tracker` until `stop`. Returns the address it listens on and its agent (shut down with
/// the gateway).
///
/// # Errors
/// A connection error when its agent cannot reach NATS, a listen error when the address is
/// taken, a configuration error when the TLS files do not read.
pub(crate) async fn start(
    bus: &crate::Bus,
    gateway: Arc<GatewayState>,
    listen: SocketAddr,
    stop: CancellationToken,
    tracker: &TaskTracker,
) -> Result<(SocketAddr, Agent)> {
    let config = &gateway.config;
    let tls = config
        .tls
        .as_ref()
        .map(crate::tls::server_config)
        .transpose()?;
    let replayer = bus
        .replay_seed_file
        .as_ref()
        .map(|path| {
            chorus_sdk::security::ConnectionSecurity::nkey_seed_file(path.clone())
                .identity()
                .map_err(Error::wrap(
                    ErrorKind::Config,
                    format!("console: the replay key {}", path.display()),
                ))
        })
        .transpose()?
        .flatten()
        .map(Arc::new);
    let agent = connect(bus).await?;
    let audit = chorus_sdk::audit::AuditSink::start(
        chorus_sdk::audit::AuditLog::new(agent.broker(), agent.subjects().clone(), CONSOLE_AGENT),
        tracker,
        stop.clone(),
    );
    let console = Arc::new(Console {
        audit,
        sessions: session::Sessions::new(
            Duration::from_secs(config.console.session_idle_secs),
            session::MAX_SESSIONS,
        ),
        tls: tls.is_some(),
        stop: stop.clone(),
        overview: overview::Samples::default(),
        refusals: agents::Refusals::default(),
        tap: tap::Counters::default(),
        agent: agent.clone(),
        gateway,
        replayer,
    });
    tracker.spawn(overview::sample(Arc::clone(&console)));
    tracker.spawn(agents::watch_refusals(Arc::clone(&console)));
    let app = router(Arc::clone(&console));
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(Error::wrap(
            ErrorKind::Listen,
            format!("console: cannot listen on {listen}"),
        ))?;
    let addr = listener
        .local_addr()
        .map_err(Error::wrap(ErrorKind::Listen, "console: no local address"))?;
    let peers = crate::conn::Peers::new(console.gateway.config.max_unproven_connections_per_peer);
    match tls {
        Some(config) => {
            let listener = crate::tls::TlsListener::new(listener, config, stop.clone(), tracker)
                .map_err(Error::wrap(ErrorKind::Listen, "console: no local address"))?;
            tracker.spawn(crate::conn::serve(
                listener,
                app,
                peers,
                stop,
                tracker.clone(),
            ));
        }
        None => {
            if !addr.ip().is_loopback() {
                tracing::warn!(
                    %addr,
                    "console serves plain HTTP off loopback (allow_plain_http): keys, \
                     tokens and session cookies cross the network in clear"
                );
            }
            tracker.spawn(crate::conn::serve(
                listener,
                app,
                peers,
                stop,
                tracker.clone(),
            ));
        }
    }
    tracing::info!(%addr, tls = console.tls, "console listening");
    Ok((addr, agent))
}

fn router(console: Arc<Console>) -> axum::Router {
    axum::Router::new()
        .route("/", get(overview::page))
        .route("/overview", get(overview::fragment))
        .route("/login", get(login_form).post(login))
        .route("/logout", post(logout))
        .route("/agents", get(agents::list))
        .route("/agents/{id}", get(agents::one))
        .route("/tasks", get(tasks::list))
        .route("/tasks/{id}", get(tasks::one))
        .route("/tasks/{id}/events", get(tasks::events))
        .route("/tasks/{id}/cancel", post(tasks::cancel))
        .route("/dlq", get(dlq::list))
        .route("/dlq/replay", post(dlq::replay_set))
        .route("/dlq/purge", post(dlq::purge))
        .route("/dlq/{id}", get(dlq::one))
        .route("/dlq/{id}/replay", post(dlq::replay_one))
        .route("/tap", get(tap::page))
        .route("/tap/events", get(tap::events))
        .route(
            "/static/console.css",
            get(|| async { asset("text/css; charset=utf-8", CSS) }),
        )
        .route(
            "/static/console.js",
            get(|| async { asset("text/javascript; charset=utf-8", JS) }),
        )
        .route("/favicon.ico", get(|| async { StatusCode::NO_CONTENT }))
        .fallback(|| async {
            html::error(
                StatusCode::NOT_FOUND,
                None,
                "there is no such page in the console",
            )
        })
        .layer(axum::middleware::map_response(html::secure))
        .layer(axum::extract::DefaultBodyLimit::max(64 * 1024))
        .with_state(console)
}

/// An embedded file, cacheable for an hour.
fn asset(content_type: &'static str, body: &'static str) -> Response {
    let mut r = ([(header::CONTENT_TYPE, content_type)], body).into_response();
    r.headers_mut().insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("private, max-age=3600"),
    );
    r
}

/// `next` if it is a path of this console (`/...`, not `//host`), else `/`.
fn local_path(next: Option<&String>) -> String {
    match next {
        Some(p) if p.starts_with('/') && !p.starts_with("//") && !p.contains('\\') => p.clone(),
        _ => "/".into(),
    }
}

fn login_page(status: StatusCode, message: &str, next: &str, token: &str) -> Response {
    let notice = if message.is_empty() {
        String::new()
    } else {
        format!(r#"<p id="error" class="error">{}</p>"#, html::esc(message))
    };
    let body = format!(
        r#"{notice}<form id="login" method="post" action="/login"><input type="hidden" name="csrf" value="{}"><input type="hidden" name="next" value="{}"><label>API key or token <input id="credential" name="credential" type="password" autocomplete="off" required autofocus></label> <button type="submit">Sign in</button></form>"#,
        html::esc(token),
        html::esc(next)
    );
    let mut r = html::html(status, html::layout("Sign in", None, &body));
    if let Ok(v) = HeaderValue::from_str(&format!(
        "{}={token}; HttpOnly; SameSite=Strict; Path=/login",
        session::LOGIN_COOKIE
    )) {
        r.headers_mut().append(header::SET_COOKIE, v);
    }
    r
}

/// `GET /login`: the form, with a fresh login CSRF token in a cookie and in the form.
async fn login_form(RawQuery(raw): RawQuery) -> Response {
    let q = query(raw.as_deref()).unwrap_or_default();
    let next = local_path(q.get("next"));
    let message = if q.contains_key("expired") {
        "your session ended: sign in again"
    } else {
        ""
    };
    match session::random_hex() {
        Ok(token) => login_page(StatusCode::OK, message, &next, &token),
        Err(e) => html::error(StatusCode::SERVICE_UNAVAILABLE, None, &e),
    }
}

/// `POST /login`: checks the credential; a session cookie and a 303 to `next`, or the form
/// again with why (401).
async fn login(State(c): State<Arc<Console>>, headers: HeaderMap, body: Bytes) -> Response {
    let again = |status, message: &str, next: &str| match session::random_hex() {
        Ok(token) => login_page(status, message, next, &token),
        Err(e) => html::error(StatusCode::SERVICE_UNAVAILABLE, None, &e),
    };
    let Ok(form) = form(&body) else {
        return again(StatusCode::BAD_REQUEST, "the form does not read", "/");
    };
    let next = local_path(form.get("next"));
    let expected = session::cookie(&headers, session::LOGIN_COOKIE).unwrap_or_default();
    let given = form.get("csrf").map(String::as_str).unwrap_or_default();
    if expected.is_empty() || !session::same(given, &expected) || !c.same_origin(&headers) {
        return again(
            StatusCode::FORBIDDEN,
            "the sign-in form expired or came from elsewhere: try again",
            &next,
        );
    }
    let credential = form.get("credential").map(|s| s.trim()).unwrap_or_default();
    let caller = match c.gateway.auth.bearer(credential) {
        Ok(caller) if !credential.is_empty() => caller,
        Ok(_) => {
            return again(
                StatusCode::UNAUTHORIZED,
                "enter an API key or a token",
                &next,
            );
        }
        Err(e) => {
            return again(
                StatusCode::UNAUTHORIZED,
                &format!("not signed in: {e}"),
                &next,
            );
        }
    };
    let (id, _) = match c.sessions.create(credential.to_owned(), Instant::now()) {
        Ok(s) => s,
        Err(e) => return html::error(StatusCode::SERVICE_UNAVAILABLE, None, &e),
    };
    tracing::info!(identity = caller.identity, "console: signed in");
    let mut r = html::see_other(&next);
    let secure = if c.tls { "; Secure" } else { "" };
    for cookie in [
        format!(
            "{}={id}; HttpOnly; SameSite=Strict; Path=/{secure}",
            session::COOKIE
        ),
        format!(
            "{}=; HttpOnly; SameSite=Strict; Path=/login; Max-Age=0",
            session::LOGIN_COOKIE
        ),
    ] {
        if let Ok(v) = HeaderValue::from_str(&cookie) {
            r.headers_mut().append(header::SET_COOKIE, v);
        }
    }
    r
}

/// `POST /logout`: ends the session (CSRF-checked like every form) and clears the cookie.
async fn logout(State(c): State<Arc<Console>>, headers: HeaderMap, body: Bytes) -> Response {
    if let Err(refused) = c.who_posts(&headers, &body, Route::Console) {
        return refused;
    }
    if let Some(id) = session::cookie(&headers, session::COOKIE) {
        c.sessions.remove(&id);
    }
    let mut r = html::see_other("/login");
    if let Ok(v) = HeaderValue::from_str(&format!(
        "{}=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0",
        session::COOKIE
    )) {
        r.headers_mut().append(header::SET_COOKIE, v);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_local_paths_are_followed_after_login() {
        let p = |s: &str| local_path(Some(&s.to_owned()));
        assert_eq!(p("/tasks?state=working"), "/tasks?state=working");
        assert_eq!(p("//evil.example/"), "/");
        assert_eq!(p("https://evil.example/"), "/");
        assert_eq!(p("/\\evil.example"), "/");
        assert_eq!(local_path(None), "/");
    }

    #[test]
    fn console_scopes_grant_reading_and_acting_apart() {
        let scope = |name: &str, routes: &[&str]| crate::ScopeConfig {
            name: name.into(),
            routes: routes.iter().map(|r| (*r).to_owned()).collect(),
            agents: vec![],
            capabilities: vec![],
        };
        let scopes = crate::scopes::Scopes::new(&[
            scope("viewer", &["console"]),
            scope("operator", &["console", "console-admin"]),
        ]);
        let who = |carried: &[&str]| Who {
            identity: "ops".into(),
            grants: scopes.grants(&carried.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>()),
            csrf: None,
        };
        let viewer = who(&["viewer"]);
        assert!(viewer.may(Route::Console) && !viewer.admin());
        let operator = who(&["operator"]);
        assert!(operator.may(Route::Console) && operator.admin());
        assert!(!who(&[]).may(Route::Console));
        // Without scopes configured, every credential may do everything.
        let open = Who {
            identity: "ops".into(),
            grants: crate::scopes::Scopes::new(&[]).grants(&[]),
            csrf: None,
        };
        assert!(open.may(Route::Console) && open.admin());
    }
}
