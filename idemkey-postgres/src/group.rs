//! Group commit: concurrent writes that commit on their own share one transaction.
//!
//! External mode makes two such writes per request (the reservation and the completion).
//! Each alone is a transaction of one row, and at a few thousand requests a second
//! PostgreSQL spends most of its time on what every transaction costs (a round trip, the
//! commit record, waking the committer) rather than on the row. A [`Group`] queues the
//! writes that arrive while earlier ones are being written, and the next writer takes all
//! of them (up to [`MAX_GROUP`]) into one statement. Nobody is answered before the
//! transaction that holds their row committed, so every answer is as durable as a write of
//! its own. A write that finds nothing running is sent at once, alone, as before.
//!
//! The writers run on tasks of their own: a request that is dropped while its write is in a
//! group does not cut short the others' transaction.

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use futures::FutureExt;
use tokio::sync::oneshot;

/// At most this many writes go in one statement.
pub(crate) const MAX_GROUP: usize = 64;

/// At most this many groups of one kind are written at the same time (each on a connection
/// of its own): the writes that arrive meanwhile wait for the next group.
pub(crate) const MAX_WRITING: usize = 2;

/// Writes of one kind (`T`, answered with `R`), grouped.
pub(crate) struct Group<T, R> {
    queue: Mutex<Queue<T, R>>,
}

struct Queue<T, R> {
    waiting: Vec<(T, oneshot::Sender<R>)>,
    writing: usize,
}

impl<T, R> Default for Group<T, R> {
    fn default() -> Self {
        Self {
            queue: Mutex::new(Queue {
                waiting: Vec::new(),
                writing: 0,
            }),
        }
    }
}

impl<T, R> Group<T, R> {
    fn lock(&self) -> MutexGuard<'_, Queue<T, R>> {
        // The queue is consistent between statements: a panic elsewhere leaves it usable.
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<T, R> fmt::Debug for Group<T, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Group").finish_non_exhaustive()
    }
}

impl<T: Send + 'static, R: Send + 'static> Group<T, R> {
    /// Queues `item` and waits for its answer. `write` writes one group and answers each of
    /// its items, in order; it is called on a writer task, with at least one item. `None`:
    /// the write of its group panicked (the writer goes on with the next group).
    pub(crate) async fn submit<W, F>(self: &Arc<Self>, item: T, write: W) -> Option<R>
    where
        W: Fn(Vec<T>) -> F + Send + 'static,
        F: Future<Output = Vec<R>> + Send + 'static,
    {
        let (answer, answered) = oneshot::channel();
        let start = {
            let mut queue = self.lock();
            queue.waiting.push((item, answer));
            let start = queue.writing < MAX_WRITING;
            if start {
                queue.writing += 1;
            }
            start
        };
        if start {
            let writer = Writer {
                group: Arc::clone(self),
            };
            tokio::spawn(writer.run(write));
        }
        answered.await.ok()
    }
}

/// A writer task's hold on its group: it counts as writing until it finds the queue empty,
/// under the same lock as a submit that would otherwise count on it.
struct Writer<T, R> {
    group: Arc<Group<T, R>>,
}

impl<T: Send + 'static, R: Send + 'static> Writer<T, R> {
    /// Writes the waiting items, a group at a time, until none are left.
    async fn run<W, F>(self, write: W)
    where
        W: Fn(Vec<T>) -> F,
        F: Future<Output = Vec<R>>,
    {
        loop {
            let (items, answers): (Vec<T>, Vec<oneshot::Sender<R>>) = {
                let mut queue = self.group.lock();
                if queue.waiting.is_empty() {
                    queue.writing -= 1;
                    return;
                }
                let take = queue.waiting.len().min(MAX_GROUP);
                queue.waiting.drain(..take).unzip()
            };
            // A panic in one group's write (a bug) answers that group `None` (its senders
            // are dropped) and must not strand the writes queued behind it.
            let Ok(results) = AssertUnwindSafe(write(items)).catch_unwind().await else {
                continue;
            };
            debug_assert_eq!(results.len(), answers.len());
            for (answer, result) in answers.into_iter().zip(results) {
                // The request that waited for it may be gone.
                let _ = answer.send(result);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::Duration;

    use futures::future::join_all;

    use super::*;

    /// 500 concurrent writes: each answered with its own result, in groups of at most
    /// `MAX_GROUP`, with no more than `MAX_WRITING` groups written at once, and none left
    /// waiting when the writers stop (the test would hang).
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn every_write_is_answered_with_its_own_result() {
        let group: Arc<Group<u32, u32>> = Arc::default();
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let writing = Arc::new(Mutex::new((0usize, 0usize)));
        let submits = (0..500u32).map(|i| {
            let (group, sizes, writing) = (group.clone(), sizes.clone(), writing.clone());
            tokio::spawn(async move {
                let write = move |items: Vec<u32>| {
                    let (sizes, writing) = (sizes.clone(), writing.clone());
                    async move {
                        {
                            let mut w = writing.lock().unwrap();
                            w.0 += 1;
                            w.1 = w.1.max(w.0);
                        }
                        sizes.lock().unwrap().push(items.len());
                        tokio::task::yield_now().await;
                        writing.lock().unwrap().0 -= 1;
                        items.into_iter().map(|i| i * 2).collect()
                    }
                };
                (i, group.submit(i, write).await)
            })
        });
        for answer in join_all(submits).await {
            let (i, answer) = answer.expect("task");
            assert_eq!(answer, Some(i * 2));
        }
        let sizes = sizes.lock().unwrap();
        assert_eq!(sizes.iter().sum::<usize>(), 500);
        assert!(
            sizes.iter().all(|&n| (1..=MAX_GROUP).contains(&n)),
            "{sizes:?}"
        );
        assert!(writing.lock().unwrap().1 <= MAX_WRITING);
        assert_eq!(group.lock().writing, 0, "the writers stopped");
    }

    /// A write that panics answers its own group `None`, and the writes queued behind it
    /// are still written: every writer panics while
    /// the others wait, and all of them are answered.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_that_panics_answers_none_and_strands_nobody() {
        let writers = u32::try_from(MAX_WRITING).expect("a few writers");
        let group: Arc<Group<u32, u32>> = Arc::default();
        let release = Arc::new(tokio::sync::Notify::new());
        let (started, mut writing) = tokio::sync::mpsc::unbounded_channel();
        let write = {
            let release = release.clone();
            move |items: Vec<u32>| {
                let (release, started) = (release.clone(), started.clone());
                async move {
                    if items.iter().any(|&i| i < writers) {
                        let released = release.notified();
                        started.send(()).expect("the test waits");
                        released.await;
                        panic!("a bug in one group's write");
                    }
                    items.into_iter().map(|i| i * 2).collect::<Vec<_>>()
                }
            }
        };
        let submit = |i: u32| {
            let (group, write) = (group.clone(), write.clone());
            tokio::spawn(async move { group.submit(i, write).await })
        };
        // Two panicking groups occupy both writers...
        let mut first = Vec::new();
        for i in 0..writers {
            first.push(submit(i));
            writing.recv().await.expect("a writer started");
        }
        // ...while the others queue behind them.
        let queued: Vec<_> = (writers..50).map(submit).collect();
        while group.lock().waiting.len() < queued.len() {
            tokio::task::yield_now().await;
        }
        release.notify_waiters();
        let answers = async {
            for task in first {
                assert_eq!(task.await.expect("task"), None);
            }
            for (i, task) in (writers..50).zip(queued) {
                assert_eq!(task.await.expect("task"), Some(i * 2));
            }
        };
        // A hang guard, not a timing assertion: a stranded write never answers.
        tokio::time::timeout(Duration::from_secs(60), answers)
            .await
            .expect("every queued write answered");
        assert_eq!(group.lock().writing, 0, "the writers stopped");
    }
}
