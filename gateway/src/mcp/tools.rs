//! The tools an MCP client sees: every capability a live agent offers, by its own name, and
//! every command of a live agent, as `<agent>.<command>`, each with what the agent's manifest
//! says of it (`EndpointInfo`): a description, an input schema, whether it runs as a task,
//! whether its reply is an MCP tool result already. A capability and a command with the same
//! name are listed once, as the capability.
//!
//! MCP's arguments are always a JSON object. Where an endpoint's schema is an object's, the
//! arguments are its payload as they are; where it is another type's (a string, say), the tool
//! takes that value as its one argument `input`. Without a schema, the tool takes any object
//! and its description says so.

use std::collections::BTreeMap;
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use chorus_sdk::registry::REPLY_MCP_TOOL_RESULT;
use chorus_sdk::schema::Schema;
use chorus_sdk::{AgentRecord, EndpointInfo, EndpointRole, StatusCode};

use crate::config::Target;
use serde_json::{Value, json};

/// The longest tool name MCP allows.
const MAX_TOOL_NAME: usize = 128;

/// The argument a tool whose payload is not an object takes it as.
pub(crate) const WRAPPED_ARGUMENT: &str = "input";

/// One tool.
pub(crate) struct Tool {
    pub(crate) name: String,
    pub(crate) target: Target,
    description: String,
    /// The schema as listed: always an object's.
    input_schema: Value,
    /// The payload is the argument `input`, not the arguments object.
    pub(crate) wrapped: bool,
    /// Checks the payload, when the agent gave a schema.
    validator: Option<Schema>,
    /// It runs as a Chorus task.
    pub(crate) task: bool,
    /// Its reply's payload is an MCP tool result already.
    pub(crate) mcp_result: bool,
}

impl Tool {
    /// The tool as `tools/list` lists it.
    pub(crate) fn listed(&self) -> Value {
        let mut tool = json!({
            "name": self.name,
            "title": self.name,
            "description": self.description,
            "inputSchema": self.input_schema,
        });
        if self.task {
            // MCP tasks: the call may run as one (`tasks/get`, `tasks/result`), or block.
            tool["execution"] = json!({"taskSupport": "optional"});
        }
        tool
    }

    /// The payload a call with `arguments` sends, or why the arguments do not do.
    pub(crate) fn payload(&self, arguments: Option<&Value>) -> Result<Value, String> {
        let arguments = match arguments {
            None | Some(Value::Null) => Value::Object(serde_json::Map::new()),
            Some(a @ Value::Object(_)) => a.clone(),
            Some(_) => return Err("arguments: a JSON object".to_owned()),
        };
        let payload = if self.wrapped {
            match arguments.get(WRAPPED_ARGUMENT) {
                Some(v) => v.clone(),
                None => return Err(format!("arguments: {WRAPPED_ARGUMENT} is required")),
            }
        } else {
            arguments
        };
        if let Some(validator) = &self.validator {
            let errors = validator.errors(&payload, 3);
            if !errors.is_empty() {
                return Err(format!(
                    "the arguments do not follow the tool's input schema: {}",
                    errors.join("; ")
                ));
            }
        }
        Ok(payload)
    }
}

/// The tools of the live agents, by name.
#[derive(Default)]
pub(crate) struct Table {
    tools: BTreeMap<String, Tool>,
    /// Changes when a tool comes, goes or changes (`notifications/tools/list_changed`).
    pub(crate) fingerprint: u64,
}

impl Table {
    /// The tools `records` (the registry's live agents) offer.
    pub(crate) fn new(records: &[AgentRecord]) -> Table {
        let mut tools = BTreeMap::new();
        let mut hasher = DefaultHasher::new();
        // Capabilities first: they keep their names.
        for record in records {
            for capability in &record.manifest.capabilities {
                let name = &capability.name;
                if tools.contains_key(name) || name.len() > MAX_TOOL_NAME {
                    continue;
                }
                // What any holder says of it.
                let info = records
                    .iter()
                    .find_map(|r| info_of(&r.manifest.endpoints, EndpointRole::Capability, name));
                let described = info.and_then(|i| i.description.clone()).unwrap_or_else(|| {
                    format!(
                        "The capability {name} on the Chorus bus: any live agent offering it answers."
                    )
                });
                let tool = tool(
                    name.clone(),
                    Target::Capability(name.clone()),
                    described,
                    info,
                );
                tools.insert(name.clone(), tool);
            }
        }
        for record in records {
            let agent = &record.manifest.agent;
            for command in &record.manifest.commands {
                let name = format!("{agent}.{command}");
                if tools.contains_key(&name) || name.len() > MAX_TOOL_NAME {
                    continue;
                }
                let info = info_of(&record.manifest.endpoints, EndpointRole::Command, command);
                let described = info.and_then(|i| i.description.clone()).unwrap_or_else(|| {
                    format!("The command {command} of the Chorus agent {agent}.")
                });
                let target = Target::Command {
                    agent: agent.clone(),
                    command: command.clone(),
                };
                tools.insert(name.clone(), tool(name, target, described, info));
            }
        }
        for tool in tools.values() {
            tool.name.hash(&mut hasher);
            tool.description.hash(&mut hasher);
            tool.input_schema.to_string().hash(&mut hasher);
        }
        Table {
            tools,
            fingerprint: hasher.finish(),
        }
    }

    /// The tool called `name`.
    pub(crate) fn get(&self, name: &str) -> Option<&Tool> {
        self.tools.get(name)
    }

    /// Every tool `allowed` lets the caller see, in name order.
    pub(crate) fn visible<'a>(
        &'a self,
        allowed: impl Fn(&Tool) -> bool + 'a,
    ) -> impl Iterator<Item = &'a Tool> + 'a {
        self.tools.values().filter(move |t| allowed(t))
    }
}

fn info_of<'a>(
    endpoints: &'a [EndpointInfo],
    role: EndpointRole,
    name: &str,
) -> Option<&'a EndpointInfo> {
    endpoints.iter().find(|e| e.kind == role && e.name == name)
}

/// The tool for `target`, from what its manifest entry says (if anything).
fn tool(name: String, target: Target, described: String, info: Option<&EndpointInfo>) -> Tool {
    let schema = info
        .and_then(|i| i.input_schema.clone())
        .filter(Value::is_object);
    let validator = schema.as_ref().and_then(|s| Schema::compile(s).ok());
    let task = info.is_some_and(|i| i.task);
    let mcp_result = info.is_some_and(|i| i.reply.as_deref() == Some(REPLY_MCP_TOOL_RESULT));
    let mut description = described;
    if task {
        description.push_str(" It runs as a Chorus task: its progress is reported as it works.");
    }
    let (input_schema, wrapped, validator) = match (schema, validator) {
        (Some(schema), Some(validator)) if is_object_schema(&schema) => {
            (schema, false, Some(validator))
        }
        (Some(schema), Some(validator)) => (
            json!({
                "type": "object",
                "properties": { WRAPPED_ARGUMENT: schema },
                "required": [WRAPPED_ARGUMENT],
            }),
            true,
            Some(validator),
        ),
        _ => {
            description.push_str(
                " No input schema is published: the arguments object is sent as the payload as it is.",
            );
            (json!({"type": "object"}), false, None)
        }
    };
    Tool {
        name,
        target,
        description,
        input_schema,
        wrapped,
        validator,
        task,
        mcp_result,
    }
}

/// Whether `schema` describes an object (MCP's `inputSchema` must).
fn is_object_schema(schema: &Value) -> bool {
    match schema.get("type") {
        Some(Value::String(t)) => t == "object",
        // No type: properties or the like still say object.
        None => schema.get("properties").is_some() || schema.get("$ref").is_some(),
        _ => false,
    }
}

/// A reply's payload as an MCP tool result: passed through when the tool answers with one,
/// else its text (a JSON string as it is, any other value as JSON) and, for an object, the
/// object as `structuredContent`.
pub(crate) fn result(payload: Value, mcp_result: bool) -> Value {
    if mcp_result
        && payload
            .get("content")
            .is_some_and(serde_json::Value::is_array)
    {
        return payload;
    }
    let text = match &payload {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let mut result = json!({"content": [{"type": "text", "text": text}]});
    if payload.is_object() {
        result["structuredContent"] = payload;
    }
    result
}

/// A Chorus refusal as an MCP tool error: the code, its label and the reason, as text and as
/// `structuredContent`.
pub(crate) fn refusal(status: StatusCode, reason: &str) -> Value {
    json!({
        "isError": true,
        "content": [{"type": "text", "text": format!("{} {}: {reason}", status.0, status.label())}],
        "structuredContent": {"status": status.0, "label": status.label(), "reason": reason},
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(
        agent: &str,
        commands: &[&str],
        capabilities: &[&str],
        info: Vec<EndpointInfo>,
    ) -> AgentRecord {
        let manifest = serde_json::json!({
            "agent": agent,
            "instance": "i",
            "capabilities": capabilities.iter().map(|c| json!({"name": c})).collect::<Vec<_>>(),
            "commands": commands,
            "heartbeat_ms": 5000,
            "started_ms": 0,
            "endpoints": info,
        });
        serde_json::from_value(json!({"manifest": manifest, "last_seen_ms": 0})).expect("a record")
    }

    fn info(name: &str, kind: EndpointRole, schema: Option<Value>, task: bool) -> EndpointInfo {
        EndpointInfo {
            name: name.into(),
            kind,
            description: Some(format!("{name} does things")),
            input_schema: schema,
            task,
            reply: None,
        }
    }

    #[test]
    fn capabilities_keep_their_names_and_commands_are_agent_dot_command() {
        let table = Table::new(&[
            record("nlp", &["analyze", "stats"], &["nlp.analyze"], Vec::new()),
            record("calculator", &["calculation"], &[], Vec::new()),
        ]);
        let names: Vec<&str> = table.visible(|_| true).map(|t| t.name.as_str()).collect();
        assert_eq!(
            names,
            ["calculator.calculation", "nlp.analyze", "nlp.stats"]
        );
        assert_eq!(
            table.get("nlp.analyze").map(|t| t.target.clone()),
            Some(Target::Capability("nlp.analyze".into()))
        );
        let open = table.get("nlp.stats").expect("a tool").listed();
        assert_eq!(open["inputSchema"], json!({"type": "object"}));
        assert!(
            open["description"]
                .as_str()
                .is_some_and(|d| d.contains("No input schema is published")),
            "{open}"
        );
    }

    #[test]
    fn a_schema_of_another_type_is_the_argument_input_and_is_checked() {
        let table = Table::new(&[record(
            "writer",
            &["draft"],
            &[],
            vec![info(
                "draft",
                EndpointRole::Command,
                Some(json!({"type": "string", "minLength": 1})),
                true,
            )],
        )]);
        let tool = table.get("writer.draft").expect("a tool");
        assert!(tool.task && tool.wrapped);
        assert_eq!(tool.listed()["inputSchema"]["required"], json!(["input"]));
        assert_eq!(
            tool.payload(Some(&json!({"input": "rivers"}))),
            Ok(json!("rivers"))
        );
        assert!(tool.payload(Some(&json!({"input": ""}))).is_err());
        assert!(tool.payload(None).is_err());
        assert!(tool.payload(Some(&json!([1]))).is_err());
    }

    #[test]
    fn object_schemas_check_the_arguments_as_they_are() {
        let schema = json!({
            "type": "object",
            "properties": {"operation": {"enum": ["add", "divide"]}, "operands": {"type": "array", "items": {"type": "number"}}},
            "required": ["operation", "operands"],
        });
        let table = Table::new(&[record(
            "calculator",
            &["calculation"],
            &[],
            vec![info(
                "calculation",
                EndpointRole::Command,
                Some(schema.clone()),
                false,
            )],
        )]);
        let tool = table.get("calculator.calculation").expect("a tool");
        assert_eq!(tool.listed()["inputSchema"], schema);
        let ok = json!({"operation": "divide", "operands": [1, 0]});
        assert_eq!(tool.payload(Some(&ok)), Ok(ok.clone()));
        let bad = tool
            .payload(Some(&json!({"operation": "modulo", "operands": [1]})))
            .expect_err("refused");
        assert!(bad.contains("/operation"), "{bad}");
    }

    #[test]
    fn replies_become_text_and_structured_content_and_tool_results_pass_through() {
        assert_eq!(
            result(json!("hello"), false),
            json!({"content": [{"type": "text", "text": "hello"}]})
        );
        assert_eq!(
            result(json!({"a": 1}), false),
            json!({"content": [{"type": "text", "text": "{\"a\":1}"}], "structuredContent": {"a": 1}})
        );
        let image =
            json!({"content": [{"type": "image", "data": "AA==", "mimeType": "image/png"}]});
        assert_eq!(result(image.clone(), true), image);
        let refused = refusal(StatusCode::INVALID_ARGUMENT, "division by zero");
        assert_eq!(refused["isError"], json!(true));
        assert_eq!(refused["structuredContent"]["status"], json!(5018));
    }

    #[test]
    fn the_fingerprint_changes_when_a_tool_comes_or_goes() {
        let one = Table::new(&[record("a", &["x"], &[], Vec::new())]);
        let same = Table::new(&[record("a", &["x"], &[], Vec::new())]);
        let two = Table::new(&[record("a", &["x", "y"], &[], Vec::new())]);
        assert_eq!(one.fingerprint, same.fingerprint);
        assert_ne!(one.fingerprint, two.fingerprint);
    }
}
