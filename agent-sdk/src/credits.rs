//! Settlement with credits (`docs/PROTOCOL.md` section 7.15): a negotiation awarded at a price
//! is recorded once in the bus's ledger, the key-value bucket `<root>_credits`, under its
//! round: who paid (the requester), who earned (the winner), for which customer, how much. The
//! requester writes the entry as it settles the round (both SDKs do), with a create that fails
//! when the round is there already, so a settlement recorded twice counts once. Balances are
//! summed from the entries when asked (`chorus credits`).

use std::collections::BTreeMap;

use bytes::Bytes;
use chorus_broker_adapter::{ErrorKind, JetStream, Kv, KvOp, KvSpec};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::error::SdkError;
use crate::protocol::codec::CodecError;
use crate::subject::Subjects;

/// The ledger bucket's name under the root (`<root>_credits`).
pub const CREDITS_BUCKET: &str = "credits";

/// One settled round in the ledger.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LedgerEntry {
    /// The negotiation round.
    pub round: Uuid,
    /// The capability the work was for.
    pub capability: String,
    /// Who pays: the requester.
    pub payer: String,
    /// Who earns: the winner.
    pub payee: String,
    /// The customer the work was for, if the round named one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub customer: Option<String>,
    /// The price agreed (the winning proposal's).
    pub price: f64,
    /// The winner's task.
    pub task: Uuid,
    /// When it was settled (ms since the Unix epoch).
    pub settled_ms: u64,
}

/// What [`Ledger::record`] did.
#[derive(Debug, Clone, PartialEq)]
pub enum Recorded {
    /// The entry is new.
    New,
    /// The round was settled before: the entry there (unchanged) is returned.
    Already(LedgerEntry),
}

/// What balances are summed by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BalanceBy {
    /// Per agent: what each earned (as a winner) and spent (as a requester).
    Agent,
    /// Per customer: what was spent for each (rounds without a customer under `-`).
    Customer,
}

/// One line of the balances.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Balance {
    /// The agent or customer.
    pub name: String,
    /// What it earned.
    pub earned: f64,
    /// What it spent (or was spent for it).
    pub spent: f64,
    /// Settled rounds it took part in.
    pub rounds: u64,
}

/// The bus's credits ledger.
#[derive(Clone)]
pub struct Ledger {
    kv: Kv,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger").finish_non_exhaustive()
    }
}

fn key(round: Uuid) -> String {
    format!("round.{round}")
}

impl Ledger {
    /// The ledger of the bus under `subjects`' root, its bucket made (with `replicas`) if it is
    /// not there.
    ///
    /// # Errors
    /// [`SdkError::Broker`] when JetStream cannot make or open the bucket.
    pub async fn open(
        js: &JetStream,
        subjects: &Subjects,
        replicas: usize,
    ) -> Result<Self, SdkError> {
        let mut spec = KvSpec::new(subjects.bucket_name(CREDITS_BUCKET));
        spec.replicas = replicas;
        spec.description = "Chorus credits: negotiations settled at a price, by round".into();
        Ok(Ledger {
            kv: js.ensure_kv(&spec).await?,
        })
    }

    /// Records `entry` unless its round is there already (then that entry is returned,
    /// unchanged): recording a settlement twice counts it once.
    ///
    /// # Errors
    /// [`SdkError::InvalidCall`] for a price that is negative or not a number;
    /// [`SdkError::Broker`] when JetStream does not take it; [`SdkError::Codec`] when the
    /// entry there does not decode.
    pub async fn record(&self, entry: &LedgerEntry) -> Result<Recorded, SdkError> {
        if !entry.price.is_finite() || entry.price < 0.0 {
            return Err(SdkError::InvalidCall(format!(
                "price {}: a settlement's price is a number, 0 or more",
                entry.price
            )));
        }
        let value = serde_json::to_vec(entry)
            .map_err(|e| CodecError::Payload(format!("ledger entry: {e}")))?;
        match self.kv.create(&key(entry.round), Bytes::from(value)).await {
            Ok(_) => Ok(Recorded::New),
            Err(e) if e.kind() == ErrorKind::Conflict => match self.entry(entry.round).await? {
                Some(there) => Ok(Recorded::Already(there)),
                None => Err(SdkError::Broker(e)),
            },
            Err(e) => Err(SdkError::Broker(e)),
        }
    }

    /// The entry of `round`, if it was settled.
    ///
    /// # Errors
    /// [`SdkError::Broker`] when JetStream does not answer; [`SdkError::Codec`] when the entry
    /// does not decode.
    pub async fn entry(&self, round: Uuid) -> Result<Option<LedgerEntry>, SdkError> {
        match self.kv.get(&key(round)).await? {
            Some(e) if e.op == KvOp::Put => {
                Ok(Some(serde_json::from_slice(&e.value).map_err(|err| {
                    CodecError::Payload(format!("ledger entry {}: {err}", e.key))
                })?))
            }
            _ => Ok(None),
        }
    }

    /// Every entry, oldest first (an entry that does not decode is skipped, and logged).
    ///
    /// # Errors
    /// [`SdkError::Broker`] when JetStream does not answer.
    pub async fn entries(&self) -> Result<Vec<LedgerEntry>, SdkError> {
        let mut out: Vec<LedgerEntry> = Vec::new();
        for e in self.kv.entries().await? {
            if e.op != KvOp::Put || !e.key.starts_with("round.") {
                continue;
            }
            match serde_json::from_slice(&e.value) {
                Ok(entry) => out.push(entry),
                Err(err) => {
                    tracing::warn!(key = %e.key, error = %err, "ledger entry skipped: not an entry")
                }
            }
        }
        out.sort_by(|a, b| a.settled_ms.cmp(&b.settled_ms).then(a.round.cmp(&b.round)));
        Ok(out)
    }
}

/// The balances of `entries`, by agent or customer, by name.
pub fn balances(entries: &[LedgerEntry], by: BalanceBy) -> Vec<Balance> {
    let mut lines: BTreeMap<String, Balance> = BTreeMap::new();
    let mut add = |name: &str, earned: f64, spent: f64| {
        let line = lines.entry(name.to_owned()).or_insert_with(|| Balance {
            name: name.to_owned(),
            ..Balance::default()
        });
        line.earned += earned;
        line.spent += spent;
        line.rounds += 1;
    };
    for e in entries {
        match by {
            BalanceBy::Agent => {
                add(&e.payer, 0.0, e.price);
                add(&e.payee, e.price, 0.0);
            }
            BalanceBy::Customer => add(e.customer.as_deref().unwrap_or("-"), 0.0, e.price),
        }
    }
    lines.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(payer: &str, payee: &str, customer: Option<&str>, price: f64) -> LedgerEntry {
        LedgerEntry {
            round: Uuid::now_v7(),
            capability: "summarize".into(),
            payer: payer.into(),
            payee: payee.into(),
            customer: customer.map(str::to_owned),
            price,
            task: Uuid::now_v7(),
            settled_ms: 1,
        }
    }

    #[test]
    fn balances_sum_what_each_agent_earned_and_spent_and_each_customer_spent() {
        let entries = [
            entry("orchestrator", "fast", Some("acme"), 1.0),
            entry("orchestrator", "careful", Some("acme"), 5.0),
            entry("planner", "fast", None, 2.5),
        ];
        let by_agent = balances(&entries, BalanceBy::Agent);
        let line = |name: &str| {
            by_agent
                .iter()
                .find(|b| b.name == name)
                .expect("as expected")
                .clone()
        };
        assert_eq!((line("fast").earned, line("fast").rounds), (3.5, 2));
        assert_eq!(line("orchestrator").spent, 6.0);
        assert_eq!(line("planner").spent, 2.5);
        assert_eq!(line("careful").spent, 0.0);
        let by_customer = balances(&entries, BalanceBy::Customer);
        assert_eq!(
            by_customer
                .iter()
                .map(|b| (b.name.as_str(), b.spent))
                .collect::<Vec<_>>(),
            [("-", 2.5), ("acme", 6.0)]
        );
    }

    #[test]
    fn an_entry_reads_back_as_written() {
        let e = entry("a", "b", Some("c"), 0.5);
        let json = serde_json::to_value(&e).expect("as expected");
        assert_eq!(json["price"], 0.5);
        assert_eq!(json["customer"], "c");
        let back: LedgerEntry = serde_json::from_value(json).expect("as expected");
        assert_eq!(back, e);
    }
}
