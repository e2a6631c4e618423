//! JSON Schema as the SDK checks payloads with it (a verified task's output, a described
//! endpoint's input, the gateway's MCP tool arguments): a schema compiled once (the dialect its
//! `$schema` names, 2020-12 by default), and where a value breaks it.

use std::sync::Arc;

use serde_json::Value;

/// A compiled JSON Schema.
#[derive(Clone)]
pub struct Schema(Arc<jsonschema::Validator>);

impl std::fmt::Debug for Schema {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Schema").finish_non_exhaustive()
    }
}

impl Schema {
    /// Compiles `schema`.
    ///
    /// # Errors
    /// Why it does not compile.
    pub fn compile(schema: &Value) -> Result<Schema, String> {
        jsonschema::validator_for(schema)
            .map(|v| Schema(Arc::new(v)))
            .map_err(|e| format!("the JSON Schema does not compile: {e}"))
    }

    /// How `value` breaks the schema, at most `max` ways, each at its place
    /// (`/operation: "modulo" is not one of ...`); empty when it holds.
    pub fn errors(&self, value: &Value, max: usize) -> Vec<String> {
        self.0
            .iter_errors(value)
            .take(max)
            .map(|e| {
                let at = e.instance_path().to_string();
                if at.is_empty() {
                    e.to_string()
                } else {
                    format!("{at}: {e}")
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_where_a_value_breaks_the_schema() {
        let schema = Schema::compile(&serde_json::json!({
            "type": "object",
            "properties": {"n": {"type": "integer"}},
            "required": ["n"],
        }))
        .expect("compiles");
        assert!(schema.errors(&serde_json::json!({"n": 1}), 5).is_empty());
        let errors = schema.errors(&serde_json::json!({"n": "one"}), 5);
        assert_eq!(errors.len(), 1);
        assert!(errors[0].starts_with("/n: "), "{errors:?}");
        assert!(Schema::compile(&serde_json::json!({"type": 12})).is_err());
    }
}
