//! Kubernetes Events (`events.k8s.io/v1`) about a deployment, each saying what just happened.
//!
//! kube-runtime's `Recorder` folds every event with the same type, reason, object and related
//! object into one series that keeps the *first* note, so a later event with the same reason
//! showed stale text (`InvalidSpec (x3)` with the first problem, `MigrationStarted (x4)` naming
//! the first Job). This publisher folds an event into a series only when its note is the same
//! too: a repeated identical event counts up, a new message is a new Event.

use std::collections::HashMap;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event as K8sEvent, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::Client;
use tokio::sync::Mutex;

/// How long an event can still be folded into: after this, the same note is a new Event.
const SERIES_WINDOW: SignedDuration = SignedDuration::from_mins(6);

/// The Events API refuses notes over 1 kB.
pub const NOTE_LIMIT: usize = 1024;

/// Normal or Warning.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventType {
    Normal,
    Warning,
}

/// One event to publish.
#[derive(Debug, Clone)]
pub struct Event {
    pub type_: EventType,
    /// CamelCase, e.g. `InvalidSpec`.
    pub reason: &'static str,
    /// What happened; cut to [`NOTE_LIMIT`] bytes (its end kept) if longer.
    pub note: String,
    /// The child the event is about (e.g. the migration Job), shown as `related`.
    pub related: Option<ObjectReference>,
}

/// What makes two events the same occurrence.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    type_: EventType,
    reason: &'static str,
    note: String,
    regarding: (Option<String>, Option<String>, Option<String>),
    related: Option<(Option<String>, Option<String>, Option<String>)>,
}

fn identity(r: &ObjectReference) -> (Option<String>, Option<String>, Option<String>) {
    (r.namespace.clone(), r.name.clone(), r.uid.clone())
}

/// Publishes events as `controller` (this replica: `instance`).
pub struct Publisher {
    client: Client,
    controller: String,
    instance: String,
    recent: Mutex<HashMap<Key, K8sEvent>>,
}

impl Publisher {
    pub fn new(client: Client, controller: &str, instance: &str) -> Self {
        Publisher {
            client,
            controller: controller.to_owned(),
            instance: instance.to_owned(),
            recent: Mutex::new(HashMap::new()),
        }
    }

    /// Creates the event about `regarding`, or counts it up if the same one was published
    /// within the last minutes.
    pub async fn publish(
        &self,
        event: &Event,
        regarding: &ObjectReference,
    ) -> Result<(), kube::Error> {
        let now = Timestamp::now();
        let note = bounded_note(&event.note);
        let key = Key {
            type_: event.type_,
            reason: event.reason,
            note: note.clone(),
            regarding: identity(regarding),
            related: event.related.as_ref().map(identity),
        };
        let namespace = regarding.namespace.clone().unwrap_or_default();
        let api: Api<K8sEvent> = Api::namespaced(self.client.clone(), &namespace);
        let mut recent = self.recent.lock().await;
        recent.retain(|_, e| last_seen(e) + SERIES_WINDOW > now);
        let published = match recent.get(&key) {
            Some(earlier) => {
                let mut again = earlier.clone();
                again.series = Some(EventSeries {
                    count: earlier.series.as_ref().map_or(2, |s| s.count + 1),
                    last_observed_time: MicroTime(now),
                });
                let patch = serde_json::json!({ "series": again.series });
                api.patch(
                    again.metadata.name.as_deref().unwrap_or_default(),
                    &PatchParams::default(),
                    &Patch::Merge(&patch),
                )
                .await?;
                again
            }
            None => {
                let new = K8sEvent {
                    metadata: ObjectMeta {
                        namespace: Some(namespace.clone()),
                        name: Some(format!(
                            "{}.{:x}",
                            regarding.name.as_deref().unwrap_or(&self.controller),
                            now.as_nanosecond()
                        )),
                        ..ObjectMeta::default()
                    },
                    event_time: Some(MicroTime(now)),
                    type_: Some(
                        match event.type_ {
                            EventType::Normal => "Normal",
                            EventType::Warning => "Warning",
                        }
                        .to_owned(),
                    ),
                    reason: Some(event.reason.to_owned()),
                    action: Some("Reconcile".to_owned()),
                    note: Some(note),
                    regarding: Some(regarding.clone()),
                    related: event.related.clone(),
                    reporting_controller: Some(self.controller.clone()),
                    reporting_instance: Some(self.instance.clone()),
                    ..K8sEvent::default()
                };
                api.create(&PostParams::default(), &new).await?
            }
        };
        recent.insert(key, published);
        Ok(())
    }
}

fn last_seen(e: &K8sEvent) -> Timestamp {
    e.series
        .as_ref()
        .map(|s| s.last_observed_time.0)
        .or(e.event_time.as_ref().map(|t| t.0))
        .unwrap_or(Timestamp::UNIX_EPOCH)
}

/// `note` within the Events API's limit; a longer one keeps its end (where what failed is said).
pub fn bounded_note(note: &str) -> String {
    keep_end(note, NOTE_LIMIT)
}

/// At most `limit` bytes of `text`, its end kept, prefixed with `…` when cut.
pub fn keep_end(text: &str, limit: usize) -> String {
    if text.len() <= limit {
        return text.to_owned();
    }
    let marker = "…";
    let mut start = text.len() - (limit - marker.len());
    while !text.is_char_boundary(start) {
        start += 1;
    }
    format!("{marker}{}", &text[start..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_note_keeps_its_end_within_the_limit() {
        let note = format!("{}handlers.OrderPlaced: division by zero", "x".repeat(2000));
        let bounded = bounded_note(&note);
        assert!(bounded.len() <= NOTE_LIMIT, "{}", bounded.len());
        assert!(bounded.starts_with('…'));
        assert!(bounded.ends_with("handlers.OrderPlaced: division by zero"));
        assert_eq!(bounded_note("short"), "short");
        // Multi-byte characters are never split.
        let wide = "é".repeat(1000);
        let bounded = bounded_note(&wide);
        assert!(bounded.len() <= NOTE_LIMIT);
        assert!(bounded.trim_start_matches('…').chars().all(|c| c == 'é'));
    }
}
