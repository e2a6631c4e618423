//! The two hosting buckets as this coordinator last saw them, kept up to date by a watch of
//! each (as the registry is), so that a reconciliation, a deploy or a listing reads memory
//! rather than one key-value request per deployment and per host: at 100,000 hosted agents a
//! deploy that read both buckets made about a hundred round trips and decoded every host's
//! report twice, on a machine whose server was busy with the agents' heartbeats.
//!
//! A change is kept only when its revision is newer than the last one seen for its key
//! (deletes included), so a watch that delivers a value late, or again after its consumer was
//! recreated, never undoes a newer one, and this coordinator's own writes count at once.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use chorus_broker_adapter::{Kv, KvEntry, KvOp, KvWatch};
use chorus_hosting::protocol::{Deployment, HostReport};
use chorus_sdk::Report;
use futures::StreamExt;
use serde::de::DeserializeOwned;

use super::super::Shared;
use super::super::tasks::broker_error;

/// Times a watch that ended is opened again, one after the other, before the hosting state
/// is declared no longer followed (hosting commands then answer 5xxx unavailable).
pub(super) const REOPEN_LIMIT: u32 = 5;

/// One bucket's live values by key, and the last revision seen of every key (a delete's
/// too).
#[derive(Debug)]
pub(super) struct Bucket<T> {
    pub(super) live: BTreeMap<String, T>,
    revisions: HashMap<String, u64>,
}

impl<T> Default for Bucket<T> {
    fn default() -> Self {
        Bucket {
            live: BTreeMap::new(),
            revisions: HashMap::new(),
        }
    }
}

/// A change read from a bucket, decoded (outside the lock): `None` for a delete, or for a
/// value that does not decode (which is said, and counts as absent).
pub(super) struct Change<T> {
    key: String,
    revision: u64,
    value: Option<T>,
}

impl<T: DeserializeOwned> Change<T> {
    pub(super) fn decode(entry: KvEntry, what: &str) -> Change<T> {
        let value = match entry.op {
            KvOp::Delete => None,
            KvOp::Put => match serde_json::from_slice(&entry.value) {
                Ok(v) => Some(v),
                Err(err) => {
                    tracing::warn!(key = %entry.key, error = %err, "unreadable {what} skipped");
                    None
                }
            },
        };
        Change {
            key: entry.key,
            revision: entry.revision,
            value,
        }
    }
}

impl<T> Change<T> {
    /// A value this coordinator wrote itself, at `revision`.
    pub(super) fn written(key: &str, revision: u64, value: T) -> Change<T> {
        Change {
            key: key.to_owned(),
            revision,
            value: Some(value),
        }
    }
}

impl<T> Bucket<T> {
    /// Keeps `change` if it is newer than what was seen of its key; whether it was.
    pub(super) fn apply(&mut self, change: Change<T>) -> bool {
        if self
            .revisions
            .get(&change.key)
            .is_some_and(|seen| *seen >= change.revision)
        {
            return false;
        }
        self.revisions.insert(change.key.clone(), change.revision);
        match change.value {
            Some(v) => {
                self.live.insert(change.key, v);
            }
            None => {
                self.live.remove(&change.key);
            }
        }
        true
    }

    /// The revision of `key`'s live value.
    pub(super) fn revision(&self, key: &str) -> Option<u64> {
        self.live
            .contains_key(key)
            .then(|| self.revisions.get(key).copied())
            .flatten()
    }
}

/// Both buckets, and whether they are still followed.
#[derive(Debug)]
pub(crate) struct Seen {
    pub(super) deployments: Bucket<Deployment>,
    pub(super) hosts: Bucket<HostReport>,
    pub(super) followed: bool,
}

impl Default for Seen {
    fn default() -> Self {
        Seen {
            deployments: Bucket::default(),
            hosts: Bucket::default(),
            followed: true,
        }
    }
}

impl Seen {
    /// The hosts' latest reports.
    pub(super) fn hosts(&self) -> Vec<&HostReport> {
        self.hosts.live.values().collect()
    }
}

/// Reads both buckets into the coordinator's [`Seen`] and follows them from then on: the
/// watches are opened before the listing, so that no change falls between the two.
pub(in crate::service) async fn follow(shared: &Arc<Shared>) -> crate::error::Result<()> {
    let hosting = &shared.hosting;
    let deployments = hosting
        .deployments
        .watch()
        .await
        .map_err(broker_error("cannot watch the deployments"))?;
    let hosts = hosting
        .hosts
        .watch()
        .await
        .map_err(broker_error("cannot watch the hosts' reports"))?;
    let (listed_deployments, listed_hosts) =
        futures::try_join!(hosting.deployments.entries(), hosting.hosts.entries())
            .map_err(broker_error("cannot read the hosting buckets"))?;
    let listed_deployments: Vec<Change<Deployment>> = listed_deployments
        .into_iter()
        .map(|e| Change::decode(e, "deployment"))
        .collect();
    let listed_hosts: Vec<Change<HostReport>> = listed_hosts
        .into_iter()
        .map(|e| Change::decode(e, "host report"))
        .collect();
    hosting.seen.send_modify(|seen| {
        for change in listed_deployments {
            seen.deployments.apply(change);
        }
        for change in listed_hosts {
            seen.hosts.apply(change);
        }
    });
    spawn_follow(
        shared,
        hosting.deployments.clone(),
        deployments,
        "deployment",
        |seen| &mut seen.deployments,
    );
    spawn_follow(
        shared,
        hosting.hosts.clone(),
        hosts,
        "host report",
        |seen| &mut seen.hosts,
    );
    Ok(())
}

/// Applies `watch`'s changes to the bucket `pick` chooses until the coordinator stops; a watch
/// that ends is opened again, at most [`REOPEN_LIMIT`] times in a row, a second more apart
/// each time.
fn spawn_follow<T: DeserializeOwned + Send + 'static>(
    shared: &Arc<Shared>,
    kv: Kv,
    mut watch: KvWatch,
    what: &'static str,
    pick: fn(&mut Seen) -> &mut Bucket<T>,
) {
    let s = Arc::clone(shared);
    shared.tracker.spawn(async move {
        let mut reopened = 0u32;
        loop {
            let change = tokio::select! {
                change = watch.next() => change,
                _ = s.stop.cancelled() => break,
            };
            match change {
                Some(Ok(entry)) => {
                    reopened = 0;
                    let change = Change::decode(entry, what);
                    s.hosting
                        .seen
                        .send_if_modified(|seen| pick(seen).apply(change));
                }
                Some(Err(err)) => tracing::debug!(error = %Report(&err), "{what} watch"),
                None if reopened == REOPEN_LIMIT => {
                    tracing::error!(
                        "the {what}s' watch ended {REOPEN_LIMIT} times in a row: hosting \
                         commands are refused until the coordinator restarts"
                    );
                    s.hosting.seen.send_modify(|seen| seen.followed = false);
                    break;
                }
                None => {
                    reopened += 1;
                    let pause = Duration::from_secs(u64::from(reopened));
                    tokio::select! {
                        () = tokio::time::sleep(pause) => {}
                        _ = s.stop.cancelled() => break,
                    }
                    match kv.watch().await {
                        Ok(w) => watch = w,
                        Err(err) => {
                            tracing::warn!(error = %Report(&err), "cannot watch the {what}s again");
                        }
                    }
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(key: &str, revision: u64, value: &str) -> Change<String> {
        Change::written(key, revision, value.to_owned())
    }

    fn delete(key: &str, revision: u64) -> Change<String> {
        Change {
            key: key.to_owned(),
            revision,
            value: None,
        }
    }

    #[test]
    fn a_change_older_than_what_was_seen_of_its_key_is_ignored() {
        let mut b = Bucket::default();
        assert!(b.apply(put("a", 3, "three")));
        // The watch delivers an older value late: ignored.
        assert!(!b.apply(put("a", 2, "two")));
        assert!(!b.apply(put("a", 3, "three again")));
        assert_eq!(b.live["a"], "three");
        assert_eq!(b.revision("a"), Some(3));
        // A delete is remembered, so a put older than it does not bring the key back.
        assert!(b.apply(delete("a", 5)));
        assert!(!b.apply(put("a", 4, "four")));
        assert!(!b.live.contains_key("a"));
        assert_eq!(b.revision("a"), None);
        assert!(b.apply(put("a", 6, "six")));
        assert_eq!(b.live["a"], "six");
        // Keys are apart.
        assert!(b.apply(put("b", 1, "one")));
        assert_eq!(b.live.len(), 2);
    }

    #[test]
    fn a_value_that_does_not_decode_counts_as_absent() {
        let entry = |value: &'static [u8], revision| KvEntry {
            key: "k".into(),
            value: bytes::Bytes::from_static(value),
            revision,
            op: KvOp::Put,
        };
        let mut b: Bucket<Vec<u32>> = Bucket::default();
        assert!(b.apply(Change::decode(entry(b"[1,2]", 1), "test")));
        assert_eq!(b.live["k"], vec![1, 2]);
        assert!(b.apply(Change::decode(entry(b"{not json", 2), "test")));
        assert!(!b.live.contains_key("k"));
    }
}
