//! The authority check every coordinator command that changes the bus or reads its state runs
//! before it acts: the sender's signature verified against the key the configuration holds
//! for it (never a key the registry learned from the sender itself), then
//! [`authority::decide`](crate::authority::decide). A refusal is counted by action and reason,
//! logged with the sender's id, and answered with its code; nothing was done. Every decision,
//! either way, goes to the audit stream with the sender.

use chorus_sdk::audit::AuditRecord;
use chorus_sdk::envelope::now_ms;
use chorus_sdk::{Context, HandlerError};

use super::Shared;
use super::metrics::metrics;
use crate::authority::{Action, Proof, Role, decide};

/// The role the sender of `ctx`'s message holds for `action`, or why it may not.
pub(crate) fn authorize(
    shared: &Shared,
    ctx: &Context,
    action: Action,
) -> Result<Role, HandlerError> {
    let env = ctx.message();
    let refuse = |status: chorus_sdk::StatusCode, reason: String, label: &'static str| {
        metrics()
            .authority_refusals
            .with_label_values(&[action.name(), label])
            .inc();
        tracing::warn!(from = %env.from, id = %env.id, action = action.name(), %status, %reason, "command refused");
        shared.audit.record(
            AuditRecord::new(VIA, env.from.as_str(), action.name(), "refused")
                .status(status.0)
                .detail(reason.clone()),
        );
        HandlerError::new(status, reason)
    };
    let proof = match (
        &env.signature,
        shared.config.trusted_keys.get(env.from.as_str()),
    ) {
        (Some(_), Some(key)) => {
            let verifier = &shared.command_verifier;
            verifier.trust(&env.from, key);
            match verifier.verify(ctx.subject(), env, now_ms()) {
                Ok(()) => Proof::Verified,
                Err((status, reason)) => return Err(refuse(status, reason, status.label())),
            }
        }
        _ => Proof::Unproven,
    };
    let require_signed = shared.config.roles_require_signatures();
    let role = decide(
        &shared.config.authority,
        require_signed,
        &env.from,
        proof,
        action,
    )
    .map_err(|r| refuse(r.status, r.reason, r.label))?;
    shared.audit.record(
        AuditRecord::new(VIA, env.from.as_str(), action.name(), "ok").detail(match proof {
            Proof::Verified => "signed",
            Proof::Unproven => "unsigned",
        }),
    );
    Ok(role)
}

/// Where the coordinator's records say they were asked.
const VIA: &str = "coordinator";
