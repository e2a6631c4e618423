//! The gateway's OpenAPI 3.1 document, served at `/openapi.json`: what `api` accepts and
//! answers, checked against the running gateway by a schema-driven fuzzer in the tests.

use serde_json::{Value, json};

use crate::config::GatewayConfig;

/// The largest integer every JSON reader keeps exactly (2^53 - 1): the bound of counts and
/// durations the document allows.
const MAX_SAFE: u64 = (1 << 53) - 1;

fn error_response(description: &str) -> Value {
    json!({
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    })
}

/// Every refusal a route can answer, beside its success.
fn refusals() -> Value {
    json!({
        "400": error_response("Malformed body or query (5006, 5018)"),
        "401": error_response("Missing, unknown, invalid or expired credentials (5014, 5004)"),
        "403": error_response("Not allowed (5007, 5004)"),
        "404": error_response("No such agent, command or route (5012, 5016, 5018)"),
        "409": error_response("Conflict (5015, 5020, 5023, 5024)"),
        "413": {"description": "Body larger than the gateway's max_body_bytes"},
        "429": error_response("Rate or connection limit (5013, 5008)"),
        "500": error_response("Internal error (5022)"),
        "502": error_response("The handler failed (5017, 5025), or its reply is not JSON"),
        "503": error_response("Unavailable (5019, 5009, 5003)"),
        "504": error_response("Timed out or expired (5005, 5011)"),
        "508": error_response("Loop detected (5010)")
    })
}

fn with_refusals(ok_status: &str, ok: Value) -> Value {
    let mut responses = refusals();
    responses[ok_status] = ok;
    responses
}

/// Agentify's route: its refusals are Agentify `failure` (or `refuse`) messages, with the same
/// HTTP statuses as every route's.
fn agentify_refusals(ok: Value) -> Value {
    let mut responses = with_refusals("200", ok);
    if let Some(all) = responses.as_object_mut() {
        for (status, response) in all.iter_mut() {
            if status != "200" && response.get("content").is_some() {
                response["content"] = json!({"application/json": {"schema":
                    {"$ref": "#/components/schemas/AgentifyFailure"}}});
            }
        }
    }
    responses
}

fn json_body(schema: &str) -> Value {
    json!({
        "required": true,
        "content": {"application/json": {"schema": {"$ref": format!("#/components/schemas/{schema}")}}}
    })
}

fn ok(description: &str, schema: &str) -> Value {
    json!({
        "description": description,
        "content": {"application/json": {"schema": {"$ref": format!("#/components/schemas/{schema}")}}}
    })
}

/// Where a call goes, as the server takes it: an agent's command (`to` with `command`), or a
/// capability (with `to` for one holder of it), never both.
fn one_target() -> Value {
    json!([
        {"required": ["to", "command"], "not": {"required": ["capability"]}},
        {"required": ["capability"], "not": {"required": ["command"]}}
    ])
}

/// The schemas of IACP's routes (`iacp.rs`): its peers, the envelope it sends, what a send
/// answers, and the envelopes its poll returns.
fn iacp_schemas(name: &Value) -> Value {
    let uuid = json!({"type": "string", "format": "uuid"});
    let id_text = json!({"type": "string", "minLength": 1, "maxLength": 128});
    json!({
                "Peers": {"type": "array", "items": {
            "type": "object",
            "required": ["agent_id", "instance", "capabilities", "commands", "groups", "load", "availability", "last_seen_ms"],
            "properties": {
                "agent_id": {"type": "string"},
                "instance": {"type": "string"},
                "capabilities": {"type": "array", "items": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "name": {"type": "string"},
                        "version": {"type": "string"},
                        "models": {"type": "array", "items": {"type": "string"}},
                        "throughput": {"type": "number"},
                        "max_tokens": {"type": "integer"}
                    }
                }},
                "commands": {"type": "array", "items": {"type": "string"}},
                "groups": {"type": "array", "items": {"type": "string"}},
                "load": {"type": "number"},
                "availability": {"enum": ["available", "busy", "away"]},
                "eta_seconds": {"type": "integer"},
                "last_seen_ms": {"type": "integer"}
            }
        }},
        "IacpEnvelope": {
            "type": "object",
            "description": "An IACP 1.x envelope (fields not listed are ignored, as IACP asks)",
            "required": ["version", "message", "recipient"],
            "properties": {
                "version": {"type": "string", "pattern": "^1(\\.[0-9]{1,4}){0,2}$"},
                "message_id": id_text.clone(),
                "correlation_id": id_text,
                "sender": {"type": "object", "properties": {
                    "agent_id": name,
                    "identity_sig": {"type": "string"}
                }},
                "recipient": {"type": "object", "required": ["agent_id"], "properties": {
                    "agent_id": name,
                    "channel": name
                }},
                "timestamp": {"type": "string"},
                "ttl_seconds": {"type": "integer", "minimum": 1, "maximum": MAX_SAFE},
                "message": {"type": "object", "required": ["type"], "properties": {
                    "type": {"enum": ["request", "event", "response", "error"]},
                    "intent": name,
                    "payload": {}
                }}
            },
            "oneOf": [
                {"properties": {"message": {"required": ["intent"], "properties": {
                    "type": {"enum": ["request", "event"]}
                }}}},
                {"required": ["correlation_id"], "properties": {
                    "correlation_id": uuid,
                    "message": {"properties": {"type": {"enum": ["response", "error"]}}}
                }}
            ]
        },
        "IacpAccepted": {
            "type": "object",
            "required": ["message_id"],
            "properties": {"message_id": {"type": "string"}}
        },
        "IacpOut": {
            "type": "object",
            "required": ["version", "message_id", "correlation_id", "sender", "recipient", "timestamp", "message"],
            "properties": {
                "version": {"const": "1.0"},
                "message_id": {"type": "string"},
                "correlation_id": {"type": "string"},
                "sender": {"type": "object", "required": ["agent_id"]},
                "recipient": {"type": "object", "required": ["agent_id"]},
                "timestamp": {"type": "string"},
                "ttl_seconds": {"type": "integer"},
                "message": {"type": "object", "required": ["type", "payload"], "properties": {
                    "type": {"enum": ["request", "event", "response", "error"]},
                    "payload": {}
                }}
            }
        }
    })
}

/// The schemas of Agentify's `POST /agent/message` (`agentify.rs`).
fn agentify_schemas(name: &Value, max_timeout: u64) -> Value {
    json!({
                "AgentifyMessage": {
            "type": "object",
            "required": ["type", "to", "intent"],
            "properties": {
                "id": {"type": "string", "maxLength": 256},
                "ts": {"type": "string"},
                "type": {"const": "request"},
                "sender": {"type": "string", "description": "The caller's own identity (agent.<id>, or agent.<id>.<role>), if given"},
                "to": {"type": "array", "minItems": 1, "maxItems": 1, "items": {
                    "type": "string",
                    "description": "agent.<agent> (the intent is the command) or <agent>.<command>",
                    "pattern": "^(agent\\.)?[A-Za-z0-9_-]{1,64}(\\.[A-Za-z0-9_-]{1,64})?$"
                }},
                "intent": name,
                "task": {"type": "string", "maxLength": 2048, "description": "What is asked, in words: the header agentify-task on the bus"},
                "payload": {},
                "context": {"type": "object", "properties": {
                    "customer_id": {"type": "string", "maxLength": 256},
                    "session_id": {"type": "string", "maxLength": 256}
                }},
                "correlation": {"type": "object", "properties": {
                    "conversation_id": {"type": "string"},
                    "reply_to": {"type": "string"}
                }},
                "expected": {"type": "object", "properties": {
                    "type": {"type": "string"},
                    "timeout": {"type": "integer", "minimum": 1, "maximum": max_timeout}
                }}
            }
        },
        "AgentifyFailure": {
            "type": "object",
            "required": ["id", "ts", "type", "sender", "to", "intent", "payload"],
            "properties": {
                "id": {"type": "string"},
                "ts": {"type": "string"},
                "type": {"enum": ["failure", "refuse"]},
                "sender": {"type": "string"},
                "to": {"type": "array", "items": {"type": "string"}},
                "intent": {"type": "string", "description": "permission_denied for a refuse, else the Chorus label (timeout, no_responders, ...)"},
                "payload": {
                    "type": "object",
                    "required": ["error", "code", "label"],
                    "properties": {
                        "error": {"type": "string"},
                        "code": {"type": "integer", "minimum": 5001, "maximum": 5099},
                        "label": {"type": "string"}
                    }
                },
                "correlation": {"type": "object"}
            }
        },
        "AgentifyReply": {
            "type": "object",
            "required": ["id", "ts", "type", "sender", "to", "intent", "status", "payload"],
            "properties": {
                "id": {"type": "string"},
                "ts": {"type": "string"},
                "type": {"const": "inform"},
                "sender": {"type": "string"},
                "to": {"type": "array", "items": {"type": "string"}},
                "intent": {"const": "result"},
                "status": {"type": "integer"},
                "payload": {},
                "correlation": {"type": "object"}
            }
        }
    })
}

fn build(config: &GatewayConfig) -> Value {
    // A name is one subject token (1 to 64 characters); a dotted name 1 to 16 of them.
    let name = json!({"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"});
    let dotted =
        json!({"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}(\\.[A-Za-z0-9_-]{1,64}){0,15}$"});
    let max_wait = config.max_wait_ms;
    let max_timeout = config.max_request_timeout_ms;
    let security = json!([{"bearer": []}, {"apiKey": []}]);
    let task_id =
        json!({"name": "id", "in": "path", "required": true, "schema": {"type": "string"}});
    // The discovery filters `/v1/agents` and IACP's `/v1/peers` both take.
    let capability = json!({"name": "capability", "in": "query", "schema": dotted});
    let group = json!({"name": "group", "in": "query", "schema": name});
    let available_only =
        json!({"name": "available_only", "in": "query", "schema": {"type": "boolean"}});
    // IACP's client names itself; it must be the caller's identity (403 otherwise).
    let agent_id = json!({
        "name": "X-Agent-ID", "in": "header", "schema": name,
        "description": "IACP: the caller's own identity. On GET /v1/messages it asks for IACP's inbox"
    });
    let mut doc = json!({
        "openapi": "3.1.0",
        "info": {
            "title": "Chorus gateway",
            "version": "1.0.0",
            "description": "HTTP access to a Chorus bus. Every call acts as the edge identity its credentials name."
        },
        "security": security,
        "paths": {
            "/v1/agents": {"get": {
                "operationId": "discover",
                "summary": "Live agents, optionally those offering a capability",
                "parameters": [
                    capability, group, available_only
                ],
                "responses": with_refusals("200", ok("The agents", "Agents"))
            }},
            "/v1/peers": {"get": {
                "operationId": "iacpPeers",
                "summary": "IACP's discover: live agents as peers, optionally those offering a capability",
                "parameters": [
                    capability, group, available_only,
                    {"name": "max_load", "in": "query", "schema": {"type": "number", "minimum": 0, "maximum": 1}},
                    {"name": "capabilities", "in": "query", "description": "All of these, comma-separated",
                     "schema": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}(\\.[A-Za-z0-9_-]{1,64}){0,15}(,[A-Za-z0-9_-]{1,64}(\\.[A-Za-z0-9_-]{1,64}){0,15}){0,31}$"}},
                    {"name": "max_tokens", "in": "query", "schema": {"type": "integer", "minimum": 0, "maximum": MAX_SAFE}},
                    {"name": "priority", "in": "query", "description": "Orders the peers soonest first at this priority",
                     "schema": {"enum": ["critical", "high", "normal", "low"]}},
                    {"name": "customer", "in": "query", "description": "Agents serving this customer: its own, and those dedicated to none",
                     "schema": name},
                    agent_id.clone()
                ],
                "responses": with_refusals("200", ok("The peers", "Peers"))
            }},
            "/v1/messages": {
                "post": {
                    "operationId": "send",
                    "summary": "Publish an event, or send a command in a delivery class; or an IACP envelope",
                    "parameters": [agent_id.clone()],
                    "requestBody": {
                        "required": true,
                        "content": {"application/json": {"schema": {"oneOf": [
                            {"$ref": "#/components/schemas/Send"},
                            {"$ref": "#/components/schemas/IacpEnvelope"}
                        ]}}}
                    },
                    "responses": with_refusals("202", json!({
                        "description": "Sent (durable: stored); an IACP envelope: its message_id (a request's reply comes by poll)",
                        "content": {"application/json": {"schema": {"oneOf": [
                            {"$ref": "#/components/schemas/Sent"},
                            {"$ref": "#/components/schemas/IacpAccepted"}
                        ]}}}
                    }))
                },
                "get": {
                    "operationId": "poll",
                    "summary": "Take messages sent to the caller's identity, waiting up to wait_ms for one (with X-Agent-ID: IACP's inbox)",
                    "parameters": [
                        {"name": "recipient", "in": "query", "schema": name},
                        {"name": "wait_ms", "in": "query", "schema": {"type": "integer", "minimum": 0, "maximum": max_wait}},
                        {"name": "max", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
                        agent_id
                    ],
                    "responses": with_refusals("200", json!({
                        "description": "The messages taken (none when the wait ended); with X-Agent-ID a list of IACP envelopes",
                        "content": {"application/json": {"schema": {"oneOf": [
                            {"$ref": "#/components/schemas/Polled"},
                            {"type": "array", "items": {"$ref": "#/components/schemas/IacpOut"}}
                        ]}}}
                    }))
                }
            },
            "/v1/replies": {"post": {
                "operationId": "reply",
                "summary": "Answer a request taken by a poll",
                "requestBody": json_body("Reply"),
                "responses": with_refusals("202", ok("Delivered to the waiting caller", "Replied"))
            }},
            "/v1/requests": {"post": {
                "operationId": "request",
                "summary": "Ask an agent or a capability and wait for the reply",
                "requestBody": json_body("Request"),
                "responses": with_refusals("200", ok("The reply", "ReplyView"))
            }},
            "/v1/tasks": {"post": {
                "operationId": "submitTask",
                "summary": "Submit a task to an agent's command or a capability",
                "requestBody": json_body("SubmitTask"),
                "responses": with_refusals("202", ok("Taken (or already finished)", "Task"))
            }},
            "/v1/tasks/{id}": {"get": {
                "operationId": "getTask",
                "summary": "Where a task this identity submitted stands",
                "parameters": [task_id.clone()],
                "responses": with_refusals("200", ok("The task", "Task"))
            }},
            "/v1/tasks/{id}/cancel": {"post": {
                "operationId": "cancelTask",
                "summary": "Cancel a task; answered once the cancel is recorded",
                "parameters": [task_id.clone()],
                "responses": with_refusals("200", ok("The task, cancelled or already finished", "Task"))
            }},
            "/v1/tasks/{id}/input": {"post": {
                "operationId": "answerTask",
                "summary": "Answer a task's question (input required)",
                "parameters": [task_id.clone()],
                "requestBody": json_body("TaskInput"),
                "responses": with_refusals("202", ok("Delivered", "Replied"))
            }},
            "/v1/tasks/{id}/events": {"get": {
                "operationId": "taskEvents",
                "summary": "A task's updates as server-sent events, ending after its terminal state",
                "parameters": [task_id, {"name": "after", "in": "query", "schema": {"type": "integer", "minimum": 0, "maximum": MAX_SAFE}}],
                "responses": with_refusals("200", json!({
                    "description": "One event per update: event is its kind, id its sequence, data the update as JSON",
                    "content": {"text/event-stream": {"schema": {"type": "string"}}}
                }))
            }},
            "/agent/message": {"post": {
                "operationId": "agentifyMessage",
                "summary": "Agentify's request-reply",
                "requestBody": json_body("AgentifyMessage"),
                "responses": agentify_refusals(ok("The reply", "AgentifyReply"))
            }}
        },
        "components": {
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer", "description": "A JWT (HS256 or EdDSA) or an API key"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"}
            },
            "schemas": {
                "Error": {
                    "type": "object",
                    "required": ["status", "label", "reason"],
                    "properties": {
                        "status": {"type": "integer", "minimum": 5001, "maximum": 5099},
                        "label": {"type": "string"},
                        "reason": {"type": "string"}
                    }
                },
                "Agents": {
                    "type": "object",
                    "required": ["agents"],
                    "properties": {"agents": {"type": "array", "items": {
                        "type": "object",
                        "required": ["id", "instance", "capabilities", "commands", "groups", "load", "availability", "last_seen_ms"],
                        "properties": {
                            "id": {"type": "string"},
                            "instance": {"type": "string"},
                            "capabilities": {"type": "array", "items": {"type": "string"}},
                            "commands": {"type": "array", "items": {"type": "string"}},
                            "groups": {"type": "array", "items": {"type": "string"}},
                            "load": {"type": "number"},
                            "availability": {"type": "string"},
                            "last_seen_ms": {"type": "integer"}
                        }
                    }}}
                },
                "Send": {
                    "type": "object",
                    "additionalProperties": false,
                    "oneOf": [
                        {"required": ["topic"], "not": {"anyOf": [
                            {"required": ["to"]}, {"required": ["command"]},
                            {"required": ["delivery"]}, {"required": ["ttl_ms"]}
                        ]}},
                        {"required": ["to", "command"], "not": {"required": ["topic"]}}
                    ],
                    "properties": {
                        "to": name,
                        "command": name,
                        "topic": dotted,
                        "payload": {},
                        "delivery": {"enum": ["at_most_once", "at_least_once", "exactly_once"]},
                        "priority": {"enum": ["low", "normal", "high", "critical"]},
                        "ttl_ms": {"type": "integer", "minimum": 1, "maximum": MAX_SAFE}
                    }
                },
                "Sent": {
                    "type": "object",
                    "required": ["id", "kind", "delivery", "duplicate"],
                    "properties": {
                        "id": {"type": ["string", "null"], "format": "uuid"},
                        "kind": {"enum": ["event", "command"]},
                        "delivery": {"enum": ["at_most_once", "at_least_once", "exactly_once"]},
                        "stream_seq": {"type": "integer"},
                        "duplicate": {"type": "boolean"}
                    }
                },
                "Polled": {
                    "type": "object",
                    "required": ["messages"],
                    "properties": {"messages": {"type": "array", "items": {
                        "type": "object",
                        "required": ["id", "from", "command", "kind", "delivery", "reply_expected", "conversation", "timestamp_ms", "attempt", "payload"],
                        "properties": {
                            "id": {"type": "string", "format": "uuid"},
                            "from": {"type": "string"},
                            "command": {"type": "string"},
                            "kind": {"type": "string"},
                            "delivery": {"type": "string"},
                            "reply_expected": {"type": "boolean"},
                            "conversation": {"type": "string", "format": "uuid"},
                            "timestamp_ms": {"type": "integer"},
                            "attempt": {"type": "integer"},
                            "payload": {}
                        }
                    }}}
                },
                "Reply": {
                    "type": "object",
                    "additionalProperties": false,
                    "required": ["in_reply_to"],
                    "properties": {
                        "in_reply_to": {"type": "string", "format": "uuid"},
                        "payload": {},
                        "status": {"type": "integer", "minimum": 5001, "maximum": 5099},
                        "reason": {"type": "string"}
                    }
                },
                "Replied": {
                    "type": "object",
                    "required": ["delivered"],
                    "properties": {"delivered": {"type": "boolean"}}
                },
                "Request": {
                    "type": "object",
                    "additionalProperties": false,
                    "oneOf": one_target(),
                    "properties": {
                        "to": name,
                        "command": name,
                        "capability": dotted,
                        "payload": {},
                        "timeout_ms": {"type": "integer", "minimum": 1, "maximum": max_timeout}
                    }
                },
                "ReplyView": {
                    "type": "object",
                    "required": ["status", "label", "from", "payload"],
                    "properties": {
                        "status": {"type": "integer"},
                        "label": {"type": "string"},
                        "from": {"type": "string"},
                        "payload": {}
                    }
                },
                "SubmitTask": {
                    "type": "object",
                    "additionalProperties": false,
                    "oneOf": one_target(),
                    "properties": {
                        "to": name,
                        "command": name,
                        "capability": dotted,
                        "payload": {},
                        "deadline_ms": {"type": "integer", "minimum": 1, "maximum": MAX_SAFE}
                    }
                },
                "TaskInput": {
                    "type": "object",
                    "additionalProperties": false,
                    "properties": {"payload": {}}
                },
                "Task": {
                    "type": "object",
                    "required": ["id", "state", "status", "label", "target", "output", "agents", "submitted_ms"],
                    "properties": {
                        "id": {"type": "string", "format": "uuid"},
                        "state": {"enum": ["submitted", "accepted", "working", "input_required", "completed", "failed", "cancelled", "rejected", "expired", "queued", "running", "unknown"]},
                        "status": {"type": "integer"},
                        "label": {"type": "string"},
                        "reason": {"type": "string"},
                        "target": {"type": "string"},
                        "output": {},
                        "agents": {"type": "array", "items": {"type": "string"}},
                        "submitted_ms": {"type": "integer"},
                        "finished_ms": {"type": "integer"}
                    }
                }
            }
        }
    });
    for more in [iacp_schemas(&name), agentify_schemas(&name, max_timeout)] {
        if let (Some(schemas), Value::Object(more)) =
            (doc["components"]["schemas"].as_object_mut(), more)
        {
            schemas.extend(more);
        }
    }
    doc
}

/// The document, as served by a gateway configured as `config` (its wait and timeout limits).
pub(crate) fn document(config: &GatewayConfig) -> String {
    build(config).to_string()
}
