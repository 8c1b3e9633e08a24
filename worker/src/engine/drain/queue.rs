//! The drain queue: the streams handed to the drain consumers, each at most once at a time —
//! waiting in the drain channel (`queued`) or being drained (`in_flight`). The claim loop,
//! which re-reads every held stream with due work on each poll, offers only the streams not
//! already there, and claims again only once the drain has room; a signal for a stream being
//! drained (the settler, a stream that stayed busy) asks the running drain to look once more
//! instead of queueing it a second time.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use tokio::sync::{mpsc, Notify};
use uuid::Uuid;

/// Why a stream is offered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Offer {
    /// A claim found it held with due work: nothing new if it is queued or being drained
    /// already (whatever made it due is seen by that drain, or by the settler after it).
    Poll,
    /// Something may have changed since it was last looked at (it could not be retired, or a
    /// drain left it busy): a running drain of it takes another pass.
    Signal,
}

/// What [`DrainQueue::offer`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Offered {
    /// Into the drain channel.
    Queued,
    /// Already queued, or being drained (a [`Offer::Signal`] marks it for another pass).
    Present,
    /// The drain channel is full: not queued (a later claim offers it again).
    Full,
}

#[derive(Default)]
struct State {
    queued: HashSet<Uuid>,
    /// Being drained, and whether it was signalled again meanwhile.
    in_flight: HashMap<Uuid, bool>,
}

/// The streams handed to the drain consumers; see the module comment.
pub(crate) struct DrainQueue {
    tx: mpsc::Sender<Uuid>,
    state: Mutex<State>,
    /// Rung whenever streams leave the queue (drained, or dropped as duplicates).
    left: Notify,
}

impl DrainQueue {
    pub(crate) fn new(tx: mpsc::Sender<Uuid>) -> Self {
        DrainQueue {
            tx,
            state: Mutex::default(),
            left: Notify::new(),
        }
    }

    /// Hand `stream` to the drain unless it is there already.
    pub(crate) fn offer(&self, stream: Uuid, why: Offer) -> Offered {
        let mut state = self.state.lock().unwrap();
        if let Some(rerun) = state.in_flight.get_mut(&stream) {
            if why == Offer::Signal {
                *rerun = true;
            }
            return Offered::Present;
        }
        if state.queued.contains(&stream) {
            return Offered::Present;
        }
        match self.tx.try_send(stream) {
            Ok(()) => {
                state.queued.insert(stream);
                Offered::Queued
            }
            Err(_) => Offered::Full,
        }
    }

    /// Streams queued or being drained.
    pub(crate) fn len(&self) -> usize {
        let state = self.state.lock().unwrap();
        state.queued.len() + state.in_flight.len()
    }

    /// The streams queued or being drained.
    pub(crate) fn offered(&self) -> Vec<Uuid> {
        let state = self.state.lock().unwrap();
        state
            .queued
            .iter()
            .chain(state.in_flight.keys())
            .copied()
            .collect()
    }

    /// The streams being drained now.
    pub(crate) fn in_flight(&self) -> Vec<Uuid> {
        self.state
            .lock()
            .unwrap()
            .in_flight
            .keys()
            .copied()
            .collect()
    }

    /// Whether `stream` is queued or being drained.
    #[cfg(test)]
    fn contains(&self, stream: &Uuid) -> bool {
        let state = self.state.lock().unwrap();
        state.queued.contains(stream) || state.in_flight.contains_key(stream)
    }

    /// Returns once fewer than `limit` streams are queued or being drained.
    pub(crate) async fn room_below(&self, limit: usize) {
        loop {
            let left = self.left.notified();
            tokio::pin!(left);
            // Registered before the check, so a departure in between is not missed.
            left.as_mut().enable();
            if self.len() < limit {
                return;
            }
            left.await;
        }
    }

    /// A consumer took `streams` from the channel: they are being drained now. Returns the
    /// ones it should drain (a stream already being drained by another consumer is marked for
    /// another pass there instead).
    pub(crate) fn start(&self, streams: Vec<Uuid>) -> Vec<Uuid> {
        let mut state = self.state.lock().unwrap();
        let mut dropped = false;
        let mine = streams
            .into_iter()
            .filter(|s| {
                state.queued.remove(s);
                match state.in_flight.get_mut(s) {
                    Some(rerun) => {
                        *rerun = true;
                        dropped = true;
                        false
                    }
                    None => {
                        state.in_flight.insert(*s, false);
                        true
                    }
                }
            })
            .collect();
        drop(state);
        if dropped {
            self.left.notify_waiters();
        }
        mine
    }

    /// Of `streams` (being drained), the ones signalled again since the last call; clears the
    /// marks.
    pub(crate) fn take_reruns(&self, streams: &[Uuid]) -> Vec<Uuid> {
        let mut state = self.state.lock().unwrap();
        streams
            .iter()
            .filter(|s| {
                state
                    .in_flight
                    .get_mut(s)
                    .map(|r| std::mem::replace(r, false))
                    .unwrap_or(false)
            })
            .copied()
            .collect()
    }

    /// The drain of `streams` is over. Returns the ones signalled again since the last
    /// [`take_reruns`](Self::take_reruns): the caller offers them again.
    pub(crate) fn finish(&self, streams: &[Uuid]) -> Vec<Uuid> {
        let mut state = self.state.lock().unwrap();
        let reruns = streams
            .iter()
            .filter(|s| state.in_flight.remove(s) == Some(true))
            .copied()
            .collect();
        drop(state);
        self.left.notify_waiters();
        reruns
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn ids(n: usize) -> Vec<Uuid> {
        (0..n).map(|_| Uuid::now_v7()).collect()
    }

    #[test]
    fn a_stream_is_queued_once_and_a_poll_never_marks_a_running_drain() {
        let (tx, mut rx) = mpsc::channel(8);
        let q = DrainQueue::new(tx);
        let [a, b] = ids(2)[..] else { unreachable!() };
        assert_eq!(q.offer(a, Offer::Poll), Offered::Queued);
        assert_eq!(q.offer(a, Offer::Poll), Offered::Present);
        assert_eq!(q.offer(a, Offer::Signal), Offered::Present);
        assert_eq!(q.offer(b, Offer::Poll), Offered::Queued);
        assert_eq!(q.len(), 2);
        assert_eq!(rx.try_recv().unwrap(), a);
        assert_eq!(rx.try_recv().unwrap(), b);
        assert!(rx.try_recv().is_err(), "each stream sent once");

        assert_eq!(q.start(vec![a]), vec![a]);
        assert!(q.contains(&a));
        let mut offered = q.offered();
        offered.sort();
        let mut both = vec![a, b];
        both.sort();
        assert_eq!(
            offered, both,
            "a being drained, b queued: the claim passes over both"
        );
        assert_eq!(q.offer(a, Offer::Poll), Offered::Present);
        assert!(
            q.take_reruns(&[a]).is_empty(),
            "a poll asks for no extra pass"
        );
        assert_eq!(q.offer(a, Offer::Signal), Offered::Present);
        assert_eq!(q.take_reruns(&[a]), vec![a], "a signal does");
        assert!(q.take_reruns(&[a]).is_empty(), "once");
        assert_eq!(q.offer(a, Offer::Signal), Offered::Present);
        assert_eq!(q.finish(&[a]), vec![a], "signalled after the last look");
        assert!(!q.contains(&a));
        assert_eq!(q.len(), 1, "b is still queued");
        assert_eq!(
            q.offer(a, Offer::Poll),
            Offered::Queued,
            "offered again once drained"
        );
    }

    #[test]
    fn a_full_channel_leaves_the_stream_unqueued() {
        let (tx, _rx) = mpsc::channel(1);
        let q = DrainQueue::new(tx);
        let [a, b] = ids(2)[..] else { unreachable!() };
        assert_eq!(q.offer(a, Offer::Poll), Offered::Queued);
        assert_eq!(q.offer(b, Offer::Signal), Offered::Full);
        assert!(!q.contains(&b));
        assert_eq!(q.len(), 1);
    }

    #[test]
    fn a_stream_taken_by_two_consumers_is_drained_by_the_first_only() {
        let (tx, _rx) = mpsc::channel(8);
        let q = DrainQueue::new(tx);
        let [a, b] = ids(2)[..] else { unreachable!() };
        assert_eq!(q.start(vec![a]), vec![a]);
        assert_eq!(q.start(vec![a, b]), vec![b]);
        assert_eq!(
            q.take_reruns(&[a, b]),
            vec![a],
            "the first drain looks again"
        );
    }

    #[tokio::test]
    async fn room_below_waits_until_drains_finish() {
        let (tx, _rx) = mpsc::channel(8);
        let q = std::sync::Arc::new(DrainQueue::new(tx));
        let streams = ids(3);
        for s in &streams {
            q.offer(*s, Offer::Poll);
        }
        let mine = q.start(streams.clone());
        tokio::time::timeout(Duration::from_secs(1), q.room_below(4))
            .await
            .expect("3 < 4: room at once");
        let waiter = tokio::spawn({
            let q = q.clone();
            async move { q.room_below(2).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished(), "3 streams are being drained");
        assert!(q.finish(&mine[..1]).is_empty());
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished(), "2 are still being drained");
        assert!(q.finish(&mine[1..2]).is_empty());
        tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .expect("1 < 2: room")
            .unwrap();
    }
}
