//! Scopes: what a caller's credentials reach. `[[gateway.scopes]]` names each scope and what it
//! grants: route groups (`agents`, `messages`, `requests`, `tasks`, `ws`, `a2a`, `agentify`, `mcp`,
//! and the web console's `console` (every page and stream) and `console-admin` (cancel, replay,
//! purge)),
//! the agents whose commands it may call, and the capabilities it may ask for (`*` for any; a
//! capability pattern ending in `.*` for every capability under it). A JWT carries its scopes
//! in the OAuth 2 `scope` claim (space-separated) or `scp` (an array, or a space-separated
//! string); an API key in its `scopes`. A caller holds the union of its scopes' grants.
//!
//! Without any `[[gateway.scopes]]`, credentials reach everything (as before scopes existed);
//! with them, a caller whose scopes do not grant a route or a target is refused 403 (5003)
//! saying which, before anything reaches the bus.

use std::collections::HashMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// `[[gateway.scopes]]`: one scope a token or an API key can carry, and what it grants. With
/// any scope configured, a caller reaches only what its scopes grant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScopeConfig {
    /// Its name, as tokens carry it (`scope` or `scp` claim) and API keys list it.
    pub name: String,
    /// Route groups it grants: `agents`, `messages`, `requests`, `tasks`, `ws`, `a2a`,
    /// `agentify`, `mcp`, `console`, `console-admin`, or `*`.
    #[serde(default)]
    pub routes: Vec<String>,
    /// Agents whose commands it may call, or `*`.
    #[serde(default)]
    pub agents: Vec<String>,
    /// Capabilities it may ask for (`text.*` for every one under `text`), or `*`.
    #[serde(default)]
    pub capabilities: Vec<String>,
}

/// The route groups a scope can grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// `GET /v1/agents`, and IACP's `GET /v1/peers`.
    Agents,
    /// `/v1/messages` and `/v1/replies` (IACP's envelopes among them).
    Messages,
    /// `/v1/requests`.
    Requests,
    /// `/v1/tasks...`.
    Tasks,
    /// `/v1/ws`, and `/agent/ws` (with `agentify`).
    Ws,
    /// `/a2a/...`.
    A2a,
    /// `/agent/message`, and `/agent/ws` (with `ws`).
    Agentify,
    /// `/mcp`.
    Mcp,
    /// The web console's pages and streams (read only).
    Console,
    /// The web console's actions: cancel a task, replay or purge dead letters.
    ConsoleAdmin,
}

impl Route {
    /// Every route group.
    pub(crate) const ALL: [Route; 10] = [
        Route::Agents,
        Route::Messages,
        Route::Requests,
        Route::Tasks,
        Route::Ws,
        Route::A2a,
        Route::Agentify,
        Route::Mcp,
        Route::Console,
        Route::ConsoleAdmin,
    ];

    /// Its name in `routes`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Route::Agents => "agents",
            Route::Messages => "messages",
            Route::Requests => "requests",
            Route::Tasks => "tasks",
            Route::Ws => "ws",
            Route::A2a => "a2a",
            Route::Agentify => "agentify",
            Route::Mcp => "mcp",
            Route::Console => "console",
            Route::ConsoleAdmin => "console-admin",
        }
    }
}

/// What one caller's scopes grant together.
#[derive(Debug, Default)]
pub(crate) struct Grants {
    /// The scopes it carries that the gateway knows, for refusals to name.
    names: Vec<String>,
    routes: Vec<String>,
    agents: Vec<String>,
    capabilities: Vec<String>,
}

fn any_or(list: &[String], matches: impl Fn(&str) -> bool) -> bool {
    list.iter().any(|entry| entry == "*" || matches(entry))
}

impl Grants {
    /// Whether it grants route group `route`.
    pub(crate) fn route(&self, route: Route) -> bool {
        any_or(&self.routes, |r| r == route.name())
    }

    /// Whether it grants calling agent `agent`'s commands.
    pub(crate) fn agent(&self, agent: &str) -> bool {
        any_or(&self.agents, |a| a == agent)
    }

    /// Whether it names agent `agent` itself (not through `*`).
    pub(crate) fn names_agent(&self, agent: &str) -> bool {
        self.agents.iter().any(|a| a == agent)
    }

    /// Whether it grants asking for capability `capability`.
    pub(crate) fn capability(&self, capability: &str) -> bool {
        any_or(&self.capabilities, |pattern| {
            match pattern.strip_suffix(".*") {
                Some(prefix) => capability
                    .strip_prefix(prefix)
                    .is_some_and(|rest| rest.starts_with('.')),
                None => pattern == capability,
            }
        })
    }

    /// The scopes, for a refusal to name.
    pub(crate) fn names(&self) -> String {
        if self.names.is_empty() {
            "none this gateway knows".into()
        } else {
            self.names.join(" ")
        }
    }
}

/// The gateway's scopes by name.
#[derive(Debug, Default)]
pub(crate) struct Scopes {
    table: HashMap<String, ScopeConfig>,
}

impl Scopes {
    pub(crate) fn new(scopes: &[ScopeConfig]) -> Self {
        Scopes {
            table: scopes.iter().map(|s| (s.name.clone(), s.clone())).collect(),
        }
    }

    /// What `carried` grants; `None` when the gateway has no scopes (then nothing is checked).
    pub(crate) fn grants(&self, carried: &[String]) -> Option<Arc<Grants>> {
        if self.table.is_empty() {
            return None;
        }
        let mut grants = Grants::default();
        for name in carried {
            if let Some(scope) = self.table.get(name) {
                grants.names.push(name.clone());
                grants.routes.extend(scope.routes.iter().cloned());
                grants.agents.extend(scope.agents.iter().cloned());
                grants
                    .capabilities
                    .extend(scope.capabilities.iter().cloned());
            }
        }
        Some(Arc::new(grants))
    }
}

/// The scopes a JWT's claims carry: `scope` (space-separated) and `scp` (an array of names,
/// or a space-separated string).
pub(crate) fn from_claims(
    scope: Option<&serde_json::Value>,
    scp: Option<&serde_json::Value>,
) -> Vec<String> {
    let mut out = Vec::new();
    for claim in [scope, scp].into_iter().flatten() {
        match claim {
            serde_json::Value::String(s) => out.extend(s.split_whitespace().map(str::to_owned)),
            serde_json::Value::Array(list) => out.extend(
                list.iter()
                    .filter_map(serde_json::Value::as_str)
                    .map(str::to_owned),
            ),
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn scope(name: &str, routes: &[&str], agents: &[&str], capabilities: &[&str]) -> ScopeConfig {
        let owned = |l: &[&str]| l.iter().map(|s| (*s).to_owned()).collect();
        ScopeConfig {
            name: name.into(),
            routes: owned(routes),
            agents: owned(agents),
            capabilities: owned(capabilities),
        }
    }

    #[test]
    fn a_caller_holds_the_union_of_its_known_scopes() {
        let scopes = Scopes::new(&[
            scope("drafts", &["a2a", "tasks"], &["writer"], &[]),
            scope("text", &["requests"], &[], &["text.*"]),
            scope("admin", &["*"], &["*"], &["*"]),
        ]);
        let g = scopes
            .grants(&["drafts".into(), "text".into(), "unknown".into()])
            .expect("scopes are configured");
        assert!(g.route(Route::A2a) && g.route(Route::Requests) && !g.route(Route::Ws));
        assert!(g.agent("writer") && !g.agent("reader"));
        assert!(g.capability("text.summarize") && g.capability("text.a.b"));
        assert!(!g.capability("text") && !g.capability("textual.x") && !g.capability("image.x"));
        assert_eq!(g.names(), "drafts text");
        let none = scopes.grants(&[]).expect("configured");
        assert!(Route::ALL.iter().all(|r| !none.route(*r)));
        let admin = scopes.grants(&["admin".into()]).expect("configured");
        assert!(
            Route::ALL.iter().all(|r| admin.route(*r)) && admin.agent("x") && admin.capability("y")
        );
        assert!(Scopes::new(&[]).grants(&["drafts".into()]).is_none());
    }

    #[test]
    fn scopes_come_from_either_claim_in_either_form() {
        assert_eq!(from_claims(Some(&json!("a b")), None), ["a", "b"]);
        assert_eq!(from_claims(None, Some(&json!(["c", "d"]))), ["c", "d"]);
        assert_eq!(
            from_claims(Some(&json!("a")), Some(&json!("e f"))),
            ["a", "e", "f"]
        );
        assert!(from_claims(Some(&json!(3)), None).is_empty());
    }
}
