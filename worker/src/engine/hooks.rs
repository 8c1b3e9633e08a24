//! Processing hooks: what tests and embedding applications wait on instead of sleeping.
//!
//! Subscribers share one bounded broadcast channel. One that falls behind by its capacity does
//! not silently lose events: a full channel drops the event being emitted instead of evicting
//! one a subscriber has not read yet, counts it (`perspective_hook_events_dropped_total`), and
//! tells the emitter, so the lifecycle stages are not recorded as done when they were not
//! delivered (they fire again at the next start, see `lifecycle`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

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
    /// Applying one (stream, perspective) met a lock conflict with another applier (deadlock,
    /// serialization failure, lock timeout: `sqlstate`) and is retried soon: not a failure,
    /// nothing recorded. `stream_id` None and `perspective` "*": a whole `wh_drain` call.
    ContentionRetried {
        perspective: String,
        stream_id: Option<Uuid>,
        sqlstate: String,
    },
    /// Work rows were moved to the dead letters.
    DeadLettered {
        perspective: String,
        stream_id: Uuid,
        event_work_ids: Vec<i64>,
    },
    /// Batched completions were flushed (work rows deleted or stamped).
    CompletionsFlushed { count: usize },
    /// A claim poll finished: it found `streams` streams with due work and handed `queued` of
    /// them to the drain (the others were queued or being drained already).
    ClaimPolled { streams: usize, queued: usize },
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

/// Events a subscriber may fall behind by before new ones are dropped (the default).
pub const DEFAULT_CAPACITY: usize = 65_536;

#[derive(Debug)]
struct Inner {
    /// Created by the first subscriber: the buffer is megabytes, and a worker nobody subscribes
    /// to (every `perspective-worker run`) has no use for it; events emitted before then had no
    /// receiver anyway.
    events: OnceLock<broadcast::Sender<HookEvent>>,
    capacity: usize,
    /// Held from the room check to the send, so two emitters cannot both fill the last slot
    /// (the second send would evict an unread event).
    send: Mutex<()>,
    /// Events dropped because a subscriber had fallen `capacity` behind.
    dropped: AtomicU64,
    /// Where drops are also counted: the engine's `perspective_hook_events_dropped_total`.
    dropped_metric: OnceLock<prometheus::IntCounter>,
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
        Self::with_capacity(DEFAULT_CAPACITY)
    }

    /// Hooks whose subscribers may fall `capacity` events behind before events are dropped.
    pub fn with_capacity(capacity: usize) -> Self {
        Hooks {
            inner: Arc::new(Inner {
                events: OnceLock::new(),
                capacity: capacity.max(1),
                send: Mutex::new(()),
                dropped: AtomicU64::new(0),
                dropped_metric: OnceLock::new(),
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
            .get_or_init(|| broadcast::channel(self.inner.capacity).0)
            .subscribe()
    }

    /// Events dropped so far because a subscriber had fallen behind.
    pub fn dropped(&self) -> u64 {
        self.inner.dropped.load(Ordering::Relaxed)
    }

    /// Count drops in `counter` too (the engine's metric; the first engine started wins).
    pub(crate) fn count_drops_in(&self, counter: prometheus::IntCounter) {
        let _ = self.inner.dropped_metric.set(counter);
    }

    /// Emit `event` to every subscriber. False when it was dropped: a subscriber is `capacity`
    /// events behind. No subscriber at all is delivered (there is nobody to miss it).
    pub(crate) fn emit(&self, event: HookEvent) -> bool {
        let Some(events) = self.inner.events.get() else {
            return true;
        };
        let _serialised = self.inner.send.lock().unwrap_or_else(|e| e.into_inner());
        // `len` counts the values some live receiver has not seen yet.
        if events.receiver_count() > 0 && events.len() >= self.inner.capacity {
            self.inner.dropped.fetch_add(1, Ordering::Relaxed);
            if let Some(metric) = self.inner.dropped_metric.get() {
                metric.inc();
            }
            return false;
        }
        let _ = events.send(event);
        true
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

    /// Record a claim poll's result, emitting started/idle transitions: it `found` streams with
    /// due work (none: an empty poll) and handed `offered` of them to the drain.
    pub(crate) fn record_poll(&self, found: usize, offered: usize, idle_threshold: u64) {
        if found == 0 {
            let n = self
                .inner
                .consecutive_empty_polls
                .fetch_add(1, Ordering::Relaxed)
                + 1;
            if n >= idle_threshold && !self.inner.idle.swap(true, Ordering::Relaxed) {
                let _ = self.emit(HookEvent::WorkProcessingIdle);
            }
        } else {
            self.inner
                .consecutive_empty_polls
                .store(0, Ordering::Relaxed);
            if self.inner.idle.swap(false, Ordering::Relaxed) {
                let _ = self.emit(HookEvent::WorkProcessingStarted);
            }
        }
        let _ = self.emit(HookEvent::ClaimPolled {
            streams: found,
            queued: offered,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn started_and_idle_transitions_fire_once() {
        let hooks = Hooks::new();
        let mut rx = hooks.subscribe();
        hooks.record_poll(3, 3, 2);
        // Found only streams being drained already: not empty.
        hooks.record_poll(1, 0, 2);
        hooks.record_poll(0, 0, 2);
        assert!(!hooks.is_idle());
        hooks.record_poll(0, 0, 2);
        assert!(hooks.is_idle());
        hooks.record_poll(0, 0, 2);
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

    #[test]
    fn a_full_channel_drops_new_events_counted_and_keeps_the_unread_ones() {
        let hooks = Hooks::with_capacity(2);
        assert!(
            hooks.emit(HookEvent::ClaimPolled {
                streams: 0,
                queued: 0
            }),
            "no subscriber"
        );
        let mut rx = hooks.subscribe();
        let polled = |streams| HookEvent::ClaimPolled {
            streams,
            queued: streams,
        };
        assert!(hooks.emit(polled(1)));
        assert!(hooks.emit(polled(2)));
        assert!(!hooks.emit(polled(3)), "full: dropped");
        assert_eq!(hooks.dropped(), 1);
        assert_eq!(
            rx.try_recv().unwrap(),
            polled(1),
            "nothing unread was evicted"
        );
        assert!(hooks.emit(polled(4)), "room again");
        assert_eq!(rx.try_recv().unwrap(), polled(2));
        assert_eq!(rx.try_recv().unwrap(), polled(4));
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
