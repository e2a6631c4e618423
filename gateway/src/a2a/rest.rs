//! A2A 1.0's HTTP+JSON (REST) binding, beside JSON-RPC at the same endpoint and with the same
//! semantics: each route runs the JSON-RPC method it stands for (`Method::run`).
//!
//! Under an endpoint's base (`/a2a/agents/<agent>/<command>` or `/a2a/capabilities/<c>`):
//!
//! | route | method |
//! |---|---|
//! | `POST /message:send` | `SendMessage` (the body is the request) |
//! | `POST /message:stream` | `SendStreamingMessage`, as server-sent events |
//! | `GET /tasks/{id}` | `GetTask` (`?historyLength=`) |
//! | `GET /tasks` | `ListTasks` (its parameters in the query, camelCase) |
//! | `POST /tasks/{id}:cancel` | `CancelTask` |
//! | `POST` or `GET /tasks/{id}:subscribe` | `SubscribeToTask`, as server-sent events |
//! | `/tasks/{id}/pushNotificationConfigs...` | push notification configs |
//! | `GET /extendedAgentCard` | not configured (400) |
//!
//! A stream's events are bare `StreamResponse` objects. Errors are RFC 9457 problem details
//! (`application/problem+json`) with the status and type URI of the spec's section 5.4.

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, Method as Verb, StatusCode as Http, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::StreamExt;
use serde_json::{Map, Value, json};

use super::{Answer, Method, RpcError, Target, check_version, code};
use crate::GatewayState;
use crate::api;

/// How an A2A error reads over HTTP: its status and type URI (the spec's section 5.4), title,
/// and the gRPC status and reason the official SDKs read from a `google.rpc.Status`.
struct Kind {
    http: Http,
    uri: &'static str,
    title: &'static str,
    grpc: &'static str,
    reason: &'static str,
}

fn problem_kind(e: &RpcError) -> Kind {
    let kind = |http, uri, title, grpc, reason| Kind {
        http,
        uri,
        title,
        grpc,
        reason,
    };
    match e.code {
        code::TASK_NOT_FOUND => kind(
            Http::NOT_FOUND,
            "https://a2a-protocol.org/errors/task-not-found",
            "Task Not Found",
            "NOT_FOUND",
            "TASK_NOT_FOUND",
        ),
        code::TASK_NOT_CANCELABLE => kind(
            Http::CONFLICT,
            "https://a2a-protocol.org/errors/task-not-cancelable",
            "Task Not Cancelable",
            "FAILED_PRECONDITION",
            "TASK_NOT_CANCELABLE",
        ),
        code::PUSH_NOT_SUPPORTED => kind(
            Http::BAD_REQUEST,
            "https://a2a-protocol.org/errors/push-notification-not-supported",
            "Push Notification Not Supported",
            "UNIMPLEMENTED",
            "PUSH_NOTIFICATION_NOT_SUPPORTED",
        ),
        code::UNSUPPORTED => kind(
            Http::BAD_REQUEST,
            "https://a2a-protocol.org/errors/unsupported-operation",
            "Unsupported Operation",
            "UNIMPLEMENTED",
            "UNSUPPORTED_OPERATION",
        ),
        code::EXTENDED_CARD => kind(
            Http::BAD_REQUEST,
            "https://a2a-protocol.org/errors/extended-agent-card-not-configured",
            "Extended Agent Card Not Configured",
            "FAILED_PRECONDITION",
            "EXTENDED_AGENT_CARD_NOT_CONFIGURED",
        ),
        code::VERSION => kind(
            Http::BAD_REQUEST,
            "https://a2a-protocol.org/errors/version-not-supported",
            "Version Not Supported",
            "UNIMPLEMENTED",
            "VERSION_NOT_SUPPORTED",
        ),
        code::INVALID_PARAMS => kind(
            Http::BAD_REQUEST,
            "about:blank",
            "Bad Request",
            "INVALID_ARGUMENT",
            "INVALID_PARAMS",
        ),
        code::PARSE | code::INVALID_REQUEST => kind(
            Http::BAD_REQUEST,
            "about:blank",
            "Bad Request",
            "INVALID_ARGUMENT",
            "INVALID_REQUEST",
        ),
        code::METHOD_NOT_FOUND => kind(
            Http::NOT_FOUND,
            "about:blank",
            "Not Found",
            "NOT_FOUND",
            "METHOD_NOT_FOUND",
        ),
        _ => {
            let http = e
                .http
                .and_then(|h| Http::from_u16(h).ok())
                .filter(|h| h.is_client_error() || h.is_server_error())
                .unwrap_or(Http::INTERNAL_SERVER_ERROR);
            let title = http.canonical_reason().unwrap_or("Error");
            kind(http, "about:blank", title, "INTERNAL", "INTERNAL_ERROR")
        }
    }
}

/// The problem details of `e` (RFC 9457), with the `google.rpc.Status` the official SDKs
/// read as an extension member (`error`).
fn problem_body(e: &RpcError) -> (Http, Value) {
    let k = problem_kind(e);
    let body = json!({
        "type": k.uri,
        "title": k.title,
        "status": k.http.as_u16(),
        "detail": e.message,
        "error": {
            "code": k.http.as_u16(),
            "status": k.grpc,
            "message": e.message,
            "details": [{
                "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                "reason": k.reason,
                "domain": "a2a-protocol.org",
            }],
        },
    });
    (k.http, body)
}

fn problem(e: &RpcError) -> Response {
    let (http, body) = problem_body(e);
    let mut response = (http, body.to_string()).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    response
}

/// Query parameters as method params: numbers and booleans where they read as such (a value
/// that does not is left a string, for the method to refuse).
fn params_of_query(raw: Option<&str>) -> Result<Map<String, Value>, RpcError> {
    let pairs: Vec<(String, String)> = match raw {
        None => Vec::new(),
        Some(q) => serde_urlencoded::from_str(q)
            .map_err(|e| RpcError::new(code::INVALID_PARAMS, format!("the query: {e}")))?,
    };
    let mut params = Map::new();
    for (name, value) in pairs {
        let typed = match name.as_str() {
            "pageSize" | "historyLength" => value
                .parse::<i64>()
                .map_or_else(|_| Value::String(value.clone()), Value::from),
            "includeArtifacts" => match value.as_str() {
                "true" => Value::Bool(true),
                "false" => Value::Bool(false),
                _ => Value::String(value.clone()),
            },
            _ => Value::String(value),
        };
        params.insert(name, typed);
    }
    Ok(params)
}

/// What a REST route asks for, as a JSON-RPC method and its params.
fn route(
    verb: &Verb,
    rest: &str,
    query: Option<&str>,
    body: &Bytes,
) -> Result<(String, Value), RpcError> {
    let body_params = || -> Result<Value, RpcError> {
        if body.is_empty() {
            return Ok(json!({}));
        }
        serde_json::from_slice(body)
            .map_err(|e| RpcError::new(code::PARSE, format!("the body: {e}")))
    };
    let not_found = || RpcError::new(code::METHOD_NOT_FOUND, format!("no route {verb} /{rest}"));
    let segments: Vec<&str> = rest.split('/').collect();
    let method = |name: &str, params: Value| Ok((name.to_owned(), params));
    match (verb, segments.as_slice()) {
        (&Verb::POST, ["message:send"]) => method("SendMessage", body_params()?),
        (&Verb::POST, ["message:stream"]) => method("SendStreamingMessage", body_params()?),
        (&Verb::GET, ["tasks"]) => method("ListTasks", Value::Object(params_of_query(query)?)),
        (&Verb::GET, ["extendedAgentCard"]) => method("GetExtendedAgentCard", json!({})),
        (_, ["tasks", task]) => {
            let (id, action) = match task.split_once(':') {
                Some((id, action)) => (id, Some(action)),
                None => (*task, None),
            };
            let mut params = match (verb, action) {
                (&Verb::GET, None | Some("subscribe")) => params_of_query(query)?,
                (&Verb::POST, Some(_)) => match body_params()? {
                    Value::Object(map) => map,
                    _ => return Err(RpcError::new(code::INVALID_PARAMS, "the body: an object")),
                },
                _ => return Err(not_found()),
            };
            params.insert("id".into(), Value::String(id.to_owned()));
            let name = match action {
                None => "GetTask",
                Some("cancel") => "CancelTask",
                Some("subscribe") => "SubscribeToTask",
                Some(_) => return Err(not_found()),
            };
            method(name, Value::Object(params))
        }
        (_, ["tasks", task, "pushNotificationConfigs", rest @ ..]) => {
            let task = Value::String((*task).to_owned());
            match (verb, rest) {
                (&Verb::POST, []) => {
                    let mut config = match body_params()? {
                        Value::Object(map) => map,
                        _ => {
                            return Err(RpcError::new(code::INVALID_PARAMS, "the body: an object"));
                        }
                    };
                    config.insert("taskId".into(), task);
                    method("CreateTaskPushNotificationConfig", Value::Object(config))
                }
                (&Verb::GET, []) => {
                    method("ListTaskPushNotificationConfigs", json!({"taskId": task}))
                }
                (&Verb::GET, [id]) => method(
                    "GetTaskPushNotificationConfig",
                    json!({"taskId": task, "id": id}),
                ),
                (&Verb::DELETE, [id]) => method(
                    "DeleteTaskPushNotificationConfig",
                    json!({"taskId": task, "id": id}),
                ),
                _ => Err(not_found()),
            }
        }
        _ => Err(not_found()),
    }
}

/// The first path segments of the routes themselves (anything else first is a tenant).
const ROUTES: [&str; 2] = ["tasks", "extendedAgentCard"];

/// Serves one REST route of `target`.
async fn serve(
    state: Arc<GatewayState>,
    headers: HeaderMap,
    target: Target,
    verb: Verb,
    rest: String,
    query: Option<String>,
    body: Bytes,
) -> Response {
    let (edge, credential) = match api::edge(&state, &headers, crate::scopes::Route::A2a) {
        Ok(found) => found,
        Err(e) => return e.into_response(),
    };
    if let Err(e) = target.allowed(&credential) {
        return e.into_response();
    }
    if let Err(e) = check_version(&headers) {
        return problem(&e);
    }
    let call = Method {
        state: &state,
        edge,
        credential: &credential,
        target: &target,
    };
    // `/{tenant}/...`: a first segment that is not a route of its own names the tenant.
    let rest = match rest.split_once('/') {
        Some((first, after)) if !ROUTES.contains(&first) && !first.starts_with("message:") => {
            if let Err(e) = call.check_tenant(Some(&Value::String(first.to_owned()))) {
                return problem(&e);
            }
            after.to_owned()
        }
        _ => rest,
    };
    let (name, params) = match route(&verb, &rest, query.as_deref(), &body) {
        Ok(found) => found,
        Err(e) => return problem(&e),
    };
    match call.run(&name, &params).await {
        Ok(Answer::One(result)) => axum::Json(result).into_response(),
        Ok(Answer::Stream(events)) => {
            let events = events.map(|item| {
                Ok::<_, Infallible>(match item {
                    Ok(result) => Event::default().data(result.to_string()),
                    Err(e) => Event::default()
                        .event("error")
                        .data(problem_body(&e).1.to_string()),
                })
            });
            Sse::new(events)
                .keep_alive(KeepAlive::default())
                .into_response()
        }
        Err(e) => problem(&e),
    }
}

/// `/a2a/agents/{agent}/{command}/{*rest}`: the REST routes of an agent's command.
pub(crate) async fn agent_rest(
    State(state): State<Arc<GatewayState>>,
    headers: HeaderMap,
    verb: Verb,
    Path((agent, command, rest)): Path<(String, String, String)>,
    RawQuery(query): RawQuery,
    body: Bytes,
) -> Response {
    match super::agent_target(agent, command) {
        Ok(target) => serve(state, headers, target, verb, rest, query, body).await,
        Err(e) => e.into_response(),
    }
}

/// `/a2a/capabilities/{capability}/{*rest}`: the REST routes of a capability.
pub(crate) async fn capability_rest(
    State(state): State<Arc<GatewayState>>,
    headers: HeaderMap,
    verb: Verb,
    Path((capability, rest)): Path<(String, String)>,
    RawQuery(query): RawQuery,
    body: Bytes,
) -> Response {
    match super::capability_target(capability) {
        Ok(target) => serve(state, headers, target, verb, rest, query, body).await,
        Err(e) => e.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_map_to_the_methods_they_stand_for() {
        let none = Bytes::new();
        let cases = [
            (Verb::POST, "message:send", None, "SendMessage"),
            (Verb::POST, "message:stream", None, "SendStreamingMessage"),
            (
                Verb::GET,
                "tasks",
                Some("pageSize=3&includeArtifacts=true"),
                "ListTasks",
            ),
            (Verb::GET, "tasks/abc", Some("historyLength=2"), "GetTask"),
            (Verb::POST, "tasks/abc:cancel", None, "CancelTask"),
            (Verb::POST, "tasks/abc:subscribe", None, "SubscribeToTask"),
            (Verb::GET, "tasks/abc:subscribe", None, "SubscribeToTask"),
        ];
        for (verb, rest, query, expect) in cases {
            let (name, params) = route(&verb, rest, query, &none).expect("a route");
            assert_eq!(name, expect, "{verb} {rest}");
            if rest.starts_with("tasks/") {
                assert_eq!(params["id"], "abc");
            }
        }
        let (_, params) = route(
            &Verb::GET,
            "tasks",
            Some("pageSize=3&includeArtifacts=true&pageToken=x"),
            &none,
        )
        .expect("list");
        assert_eq!(
            params,
            json!({"pageSize": 3, "includeArtifacts": true, "pageToken": "x"})
        );
        let (_, params) = route(&Verb::GET, "tasks", Some("pageSize=many"), &none).expect("list");
        assert_eq!(params["pageSize"], "many");
        for (verb, rest) in [
            (Verb::DELETE, "tasks/abc"),
            (Verb::POST, "tasks/abc:pause"),
            (Verb::GET, "nothing"),
        ] {
            let err = route(&verb, rest, None, &none).expect_err("no route");
            assert_eq!(err.code, code::METHOD_NOT_FOUND);
        }
    }

    #[test]
    fn errors_are_problem_details_with_the_spec_statuses() {
        let (http, body) = problem_body(&RpcError::new(code::TASK_NOT_FOUND, "no task x"));
        assert_eq!(http, Http::NOT_FOUND);
        assert_eq!(
            body["type"],
            "https://a2a-protocol.org/errors/task-not-found"
        );
        assert_eq!(body["detail"], "no task x");
        assert_eq!(body["error"]["details"][0]["reason"], "TASK_NOT_FOUND");
        assert_eq!(
            problem_body(&RpcError::new(code::TASK_NOT_CANCELABLE, "")).0,
            Http::CONFLICT
        );
        assert_eq!(
            problem_body(&RpcError::new(code::INVALID_PARAMS, "")).0,
            Http::BAD_REQUEST
        );
        assert_eq!(
            problem_body(&RpcError::new(code::VERSION, "")).0,
            Http::BAD_REQUEST
        );
    }
}
