//! Processing hooks: what tests and embedding applications wait on instead of sleeping.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use tokio::sync::{broadcast, Notify};
use uuid::Uuid;

/// Something the engine did.
#[derive(Debug, Clone, PartialEq)]
pub enum HookEvent {
    /// Idle → active: a claim returned work after the engine had gone idle (or at start).
    WorkProcessingStarted,
    /// Active → idle, after `idleThresholdPolls` consecutive empty claims.
    WorkProcessingIdle,
    /// A batch of streams was claimed, applied and handed to completion.
    BatchCycleComplete { streams: usize, events_applied: u64 },
    /// Events of one (stream, perspective) were applied and committed.
    PerspectiveEventProcessed {
        perspective: String,
        stream_id: Uuid,
        event_count: u32,
        last_version: i64,
    },
    /// An event failed to apply (it will be retried with backoff, or dead-lettered).
    PerspectiveEventFailed {
        perspective: String,
        stream_id: Uuid,
        event_work_id: i64,
        error: String,
    },
    /// Work rows were moved to the dead letters.
    DeadLettered {
        perspective: String,
        stream_id: Uuid,
        event_work_ids: Vec<i64>,
    },
    /// Batched completions were flushed (work rows deleted or stamped).
    CompletionsFlushed { count: usize },
    /// A claim poll finished; `streams` is how many streams it offered.
    ClaimPolled { streams: usize },
    /// Lifecycle (with `notifyApplied`): `perspective` applied this event (committed). Fired
    /// once per event and perspective, by the worker that applied it, before the event's
    /// `PostAllPerspectives`.
    PostPerspective {
        perspective: String,
        stream_id: Uuid,
        event_id: Uuid,
    },
    /// Lifecycle (with `notifyApplied`): every subscribed perspective has applied this event.
    /// Fired once per event, by the worker that applied the last perspective.
    PostAllPerspectives { stream_id: Uuid, event_id: Uuid },
    /// Lifecycle: the event's processing is complete; fired right after `PostAllPerspectives`,
    /// then recorded in `wh_lifecycle_completions` (orphans are fired again at startup).
    PostLifecycle { stream_id: Uuid, event_id: Uuid },
}

/// Shared hook state of one engine.
#[derive(Debug, Clone)]
pub struct Hooks {
    inner: Arc<Inner>,
}

/// Events a subscriber may fall behind by before it misses some.
const CAPACITY: usize = 65_536;

#[derive(Debug)]
struct Inner {
    /// Created by the first subscriber: the buffer is megabytes, and a worker nobody subscribes
    /// to (every `perspective-worker run`) has no use for it; events emitted before then had no
    /// receiver anyway.
    events: OnceLock<broadcast::Sender<HookEvent>>,
    consecutive_empty_polls: AtomicU64,
    idle: AtomicBool,
    wake: Notify,
}

impl Default for Hooks {
    fn default() -> Self {
        Self::new()
    }
}

impl Hooks {
    pub fn new() -> Self {
        Hooks {
            inner: Arc::new(Inner {
                events: OnceLock::new(),
                consecutive_empty_polls: AtomicU64::new(0),
                idle: AtomicBool::new(true),
                wake: Notify::new(),
            }),
        }
    }

    /// Receive every hook event from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<HookEvent> {
        self.inner
            .events
            .get_or_init(|| broadcast::channel(CAPACITY).0)
            .subscribe()
    }

    pub(crate) fn emit(&self, event: HookEvent) {
        // No subscriber is fine.
        if let Some(events) = self.inner.events.get() {
            let _ = events.send(event);
        }
    }

    /// Consecutive claim polls that returned nothing.
    pub fn consecutive_empty_polls(&self) -> u64 {
        self.inner.consecutive_empty_polls.load(Ordering::Relaxed)
    }

    /// Whether the engine is idle (no work in the last `idleThresholdPolls` polls).
    pub fn is_idle(&self) -> bool {
        self.inner.idle.load(Ordering::Relaxed)
    }

    /// Wake the claim loop now instead of at its next interval. Coalescing: many calls before
    /// the loop wakes cause one poll.
    pub fn request_immediate_poll(&self) {
        self.inner.wake.notify_one();
    }

    pub(crate) async fn wake_requested(&self) {
        self.inner.wake.notified().await
    }

    /// Record a claim poll's result, emitting started/idle transitions.
    pub(crate) fn record_poll(&self, streams: usize, idle_threshold: u64) {
        if streams == 0 {
            let n = self
                .inner
                .consecutive_empty_polls
                .fetch_add(1, Ordering::Relaxed)
                + 1;
            if n >= idle_threshold && !self.inner.idle.swap(true, Ordering::Relaxed) {
                self.emit(HookEvent::WorkProcessingIdle);
            }
        } else {
            self.inner
                .consecutive_empty_polls
                .store(0, Ordering::Relaxed);
            if self.inner.idle.swap(false, Ordering::Relaxed) {
                self.emit(HookEvent::WorkProcessingStarted);
            }
        }
        self.emit(HookEvent::ClaimPolled { streams });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn started_and_idle_transitions_fire_once() {
        let hooks = Hooks::new();
        let mut rx = hooks.subscribe();
        hooks.record_poll(3, 2);
        hooks.record_poll(1, 2);
        hooks.record_poll(0, 2);
        assert!(!hooks.is_idle());
        hooks.record_poll(0, 2);
        assert!(hooks.is_idle());
        hooks.record_poll(0, 2);
        assert_eq!(hooks.consecutive_empty_polls(), 3);
        let events: Vec<HookEvent> = std::iter::from_fn(|| rx.try_recv().ok())
            .filter(|e| !matches!(e, HookEvent::ClaimPolled { .. }))
            .collect();
        assert_eq!(
            events,
            vec![
                HookEvent::WorkProcessingStarted,
                HookEvent::WorkProcessingIdle
            ]
        );
    }

    #[tokio::test]
    async fn immediate_poll_requests_coalesce() {
        let hooks = Hooks::new();
        for _ in 0..100 {
            hooks.request_immediate_poll();
        }
        // One stored permit: the first wait returns at once, the second would block.
        tokio::time::timeout(
            std::time::Duration::from_millis(100),
            hooks.wake_requested(),
        )
        .await
        .expect("a stored wake");
        assert!(
            tokio::time::timeout(std::time::Duration::from_millis(50), hooks.wake_requested())
                .await
                .is_err()
        );
    }
}
