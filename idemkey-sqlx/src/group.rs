//! Group commit for the sqlx stores: concurrent external-mode writes that commit on their
//! own share one statement of each kind, and on PostgreSQL one transaction.
//!
//! External mode makes two such writes per request (the reservation,
//! [`Store::insert_autocommit`], and the completion, [`Store::complete_autocommit`]). Each
//! alone is a transaction of one row: PostgreSQL spends most of its time on what every
//! commit costs (a round trip, planning, the commit record, waking the committer), SQLite
//! on handing the statement to its worker thread and back. A [`GroupedWrites`] queues the
//! writes that arrive while earlier ones are being written, and the next group takes all of
//! them (up to [`MAX_GROUP`]), reservations and completions together: one statement of each
//! kind ([`GroupWriter::write_groups`]). Nobody is answered before the statement that holds
//! their row committed, so every answer is as durable as a write of its own. A write that
//! finds nothing running is sent at once, alone, as before.
//!
//! A store implements [`GroupWriter`] (its two grouped statements, and how it sends them
//! together) and keeps a [`GroupedWrites`]; [`plan`] and [`answer_each`] are the parts of a
//! grouped statement that do not depend on its SQL: which rows go in it, in which order,
//! and which writer gets which answer.
//!
//! The writer runs on a task of its own: a request that is dropped while its write is in a
//! group does not cut short the others' transaction.

use std::collections::HashSet;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use futures::FutureExt;
use tokio::sync::oneshot;

use idemkey_core::{Inserted, NewRecord, RecordId, Store, StoreError, StoredResponse, Timestamp};

/// At most this many writes go in one statement.
pub const MAX_GROUP: usize = 64;

/// A completion waiting for its group: [`Store::complete`]'s arguments.
#[derive(Debug)]
pub struct Completion {
    /// The record.
    pub id: RecordId,
    /// The owner's fencing token.
    pub token: i64,
    /// The outcome to store.
    pub response: StoredResponse,
    /// When it was written.
    pub now: Timestamp,
}

/// A store's two grouped statements. Each answers every write of its group (two or more),
/// in order, as the write alone would have been answered ([`answer_each`]); a group of one
/// is written alone.
pub trait GroupWriter: Store {
    /// One reservation, alone: [`Store::insert`] in the writer's turn
    /// ([`Store::acquire_for_write`]), what [`Store::insert_autocommit`] does by default.
    fn insert_alone(
        &self,
        record: &NewRecord,
    ) -> impl Future<Output = Result<Inserted, StoreError>> + Send {
        async move {
            let mut conn = self.acquire_for_write().await?;
            self.insert(&mut conn, record).await
        }
    }

    /// One completion, alone: [`Store::complete`] in the writer's turn, what
    /// [`Store::complete_autocommit`] does by default.
    fn complete_alone(
        &self,
        c: &Completion,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        async move {
            let mut conn = self.acquire_for_write().await?;
            self.complete(&mut conn, &c.id, c.token, &c.response, c.now)
                .await
        }
    }

    /// Reservations, each as [`Store::insert`] alone would answer it, except that a key
    /// found taken may be [`Inserted::Conflict`] (the protocol then reads the record).
    fn insert_group(
        &self,
        records: Vec<NewRecord>,
    ) -> impl Future<Output = Vec<Result<Inserted, StoreError>>> + Send;

    /// Completions, each as [`Store::complete`] alone would answer it.
    fn complete_group(
        &self,
        completions: Vec<Completion>,
    ) -> impl Future<Output = Vec<Result<bool, StoreError>>> + Send;

    /// The reservations and completions of one group, each kind answered in order as
    /// [`reserve`] and [`complete`] answer it. By default each kind is written on its own,
    /// the reservations first; a store may write both in one transaction, which is the
    /// same as writing them one after the other.
    fn write_groups(
        &self,
        records: Vec<NewRecord>,
        completions: Vec<Completion>,
    ) -> impl Future<Output = GroupAnswers> + Send {
        async move {
            (
                reserve(self, records).await,
                complete(self, completions).await,
            )
        }
    }
}

/// The answers to a group's reservations and to its completions, each in order.
pub type GroupAnswers = (
    Vec<Result<Inserted, StoreError>>,
    Vec<Result<bool, StoreError>>,
);

/// A write waiting for its group.
#[derive(Debug)]
enum Write {
    Reserve(NewRecord),
    Complete(Completion),
}

/// A write's answer.
#[derive(Debug)]
enum Answer {
    Reserved(Result<Inserted, StoreError>),
    Completed(Result<bool, StoreError>),
}

/// Reservations, each answered as [`Store::insert_autocommit`] answers it: one alone, more
/// as a group.
pub async fn reserve<S: GroupWriter>(
    store: &S,
    records: Vec<NewRecord>,
) -> Vec<Result<Inserted, StoreError>> {
    match &records[..] {
        [] => Vec::new(),
        [record] => vec![store.insert_alone(record).await],
        _ => store.insert_group(records).await,
    }
}

/// Completions, each answered as [`Store::complete_autocommit`] answers it: one alone, more
/// as a group.
pub async fn complete<S: GroupWriter>(
    store: &S,
    completions: Vec<Completion>,
) -> Vec<Result<bool, StoreError>> {
    match &completions[..] {
        [] => Vec::new(),
        [c] => vec![store.complete_alone(c).await],
        _ => store.complete_group(completions).await,
    }
}

/// A store's queue of external-mode writes, reservations and completions together.
#[derive(Debug, Clone)]
pub struct GroupedWrites {
    writes: Arc<Group<Write, Answer>>,
}

impl Default for GroupedWrites {
    /// A queue whose groups are written one at a time; the writes that arrive meanwhile wait
    /// for the next group. A second group in flight would only split them into more commits
    /// (docs/decisions.md, "Concurrent external-mode writes are committed in groups").
    fn default() -> Self {
        Self {
            writes: Arc::new(Group::new()),
        }
    }
}

impl GroupedWrites {
    /// [`Store::insert_autocommit`], grouped by `store`'s [`GroupWriter::write_groups`].
    pub async fn insert<S: GroupWriter>(
        &self,
        store: &S,
        record: &NewRecord,
    ) -> Result<Inserted, StoreError> {
        match self.submit(store, Write::Reserve(record.clone())).await {
            Some(Answer::Reserved(answer)) => answer,
            _ => Err(unanswered()),
        }
    }

    /// [`Store::complete_autocommit`], grouped by `store`'s [`GroupWriter::write_groups`].
    pub async fn complete<S: GroupWriter>(
        &self,
        store: &S,
        id: &RecordId,
        token: i64,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let completion = Completion {
            id: id.clone(),
            token,
            response: response.clone(),
            now,
        };
        match self.submit(store, Write::Complete(completion)).await {
            Some(Answer::Completed(answer)) => answer,
            _ => Err(unanswered()),
        }
    }

    /// Queues `write` for the next group. The writer splits a group by kind, has the store
    /// write both ([`GroupWriter::write_groups`]), and hands each write its kind's answer in
    /// order.
    async fn submit<S: GroupWriter>(&self, store: &S, write: Write) -> Option<Answer> {
        let store = store.clone();
        let write_group = move |writes: Vec<Write>| {
            let store = store.clone();
            async move {
                // Which writes are reservations, in order, to hand the answers back.
                let mut reserves = Vec::with_capacity(writes.len());
                let mut records = Vec::new();
                let mut completions = Vec::new();
                for write in writes {
                    reserves.push(matches!(write, Write::Reserve(_)));
                    match write {
                        Write::Reserve(record) => records.push(record),
                        Write::Complete(completion) => completions.push(completion),
                    }
                }
                let (reserved, completed) = store.write_groups(records, completions).await;
                let (mut reserved, mut completed) = (reserved.into_iter(), completed.into_iter());
                reserves
                    .into_iter()
                    .map(|reserve| {
                        if reserve {
                            Answer::Reserved(reserved.next().unwrap_or_else(|| Err(unanswered())))
                        } else {
                            Answer::Completed(completed.next().unwrap_or_else(|| Err(unanswered())))
                        }
                    })
                    .collect()
            }
        };
        self.writes.submit(write, write_group).await
    }
}

/// A group's write ended without an answer (it panicked).
fn unanswered() -> StoreError {
    StoreError::Database(Box::new(std::io::Error::other(
        "the writer of a group of writes ended without an answer",
    )))
}

/// Which of `items` go into one grouped statement, and in which order: the first write of
/// each record, in the order of the table's primary key, so that two groups never wait on
/// each other's rows in opposite orders. Returns those rows and, for each item, whether it
/// is among them; the others (a second write of the same record, such as a stale
/// completion beside its owner's) are written alone after the group ([`answer_each`]).
pub fn plan<T>(items: &[T], id: impl Fn(&T) -> &RecordId) -> (Vec<&T>, Vec<bool>) {
    let key = |i: usize| {
        let id = id(&items[i]);
        (&id.tenant, &id.key_hash, &id.route)
    };
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_by(|&a, &b| key(a).cmp(&key(b)).then(a.cmp(&b)));
    order.dedup_by(|&mut later, &mut first| key(later) == key(first));
    let mut in_group = vec![false; items.len()];
    for &i in &order {
        in_group[i] = true;
    }
    (order.into_iter().map(|i| &items[i]).collect(), in_group)
}

/// The identities a grouped statement returned (`RETURNING tenant, key_hash, route`).
pub fn returned(rows: Vec<(String, Vec<u8>, String)>) -> HashSet<RecordId> {
    rows.into_iter()
        .filter_map(|(tenant, key_hash, route)| {
            Some(RecordId {
                tenant,
                key_hash: key_hash.try_into().ok()?,
                route,
            })
        })
        .collect()
}

/// Each item's answer, in order: `from_group`'s for an item the grouped statement wrote
/// (`in_group`, from [`plan`]), unless it has none (the statement failed and it cannot
/// tell that item's fate), and otherwise `alone`'s, written after the group, one at a time.
pub async fn answer_each<'a, T, R, F>(
    items: &'a [T],
    in_group: &[bool],
    from_group: impl Fn(&'a T) -> Option<R>,
    alone: impl Fn(&'a T) -> F,
) -> Vec<R>
where
    F: Future<Output = R>,
{
    let mut answers = Vec::with_capacity(items.len());
    for (item, &in_group) in items.iter().zip(in_group) {
        let answer = match in_group.then(|| from_group(item)).flatten() {
            Some(answer) => answer,
            None => alone(item).await,
        };
        answers.push(answer);
    }
    answers
}

/// Writes of one kind (`T`, answered with `R`), grouped, written by one writer task at a
/// time.
pub(crate) struct Group<T, R> {
    queue: Mutex<Queue<T, R>>,
}

struct Queue<T, R> {
    waiting: Vec<(T, oneshot::Sender<R>)>,
    /// A writer task is running: it takes what is waiting before it stops.
    writing: bool,
}

impl<T, R> Group<T, R> {
    fn new() -> Self {
        Self {
            queue: Mutex::new(Queue {
                waiting: Vec::new(),
                writing: false,
            }),
        }
    }

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
            let start = !queue.writing;
            queue.writing = true;
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
                    queue.writing = false;
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
    /// `MAX_GROUP`, one group written at a time, and none left waiting when the writer
    /// stops (the test would hang).
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn every_write_is_answered_with_its_own_result() {
        let group: Arc<Group<u32, u32>> = Arc::new(Group::new());
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
        assert_eq!(writing.lock().unwrap().1, 1, "one group at a time");
        assert!(!group.lock().writing, "the writer stopped");
    }

    /// A plan keeps the first write of each record, in key order, and leaves the others to
    /// be written alone.
    #[test]
    fn a_plan_orders_by_key_and_keeps_the_first_write_of_each_record() {
        let id = |key: &str| RecordId {
            tenant: "t1".into(),
            key_hash: [key.as_bytes()[0]; 32],
            route: "POST /v1/transfers".into(),
        };
        let items = [
            (id("c"), 0),
            (id("a"), 1),
            (id("c"), 2),
            (id("b"), 3),
            (id("a"), 4),
        ];
        let (rows, in_group) = plan(&items, |(id, _)| id);
        let order: Vec<i32> = rows.iter().map(|(_, n)| *n).collect();
        assert_eq!(order, [1, 3, 0]);
        assert_eq!(in_group, [true, true, false, true, false]);
    }

    /// A write that panics answers its own group `None`, and the writes queued behind it
    /// are still written: the writer's group panics while the others wait, and all of them
    /// are answered.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_that_panics_answers_none_and_strands_nobody() {
        let group: Arc<Group<u32, u32>> = Arc::new(Group::new());
        let release = Arc::new(tokio::sync::Notify::new());
        let (started, mut writing) = tokio::sync::mpsc::unbounded_channel();
        let write = {
            let release = release.clone();
            move |items: Vec<u32>| {
                let (release, started) = (release.clone(), started.clone());
                async move {
                    if items.contains(&0) {
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
        // A panicking group occupies the writer...
        let first = submit(0);
        writing.recv().await.expect("the writer started");
        // ...while the others queue behind it.
        let queued: Vec<_> = (1..50).map(submit).collect();
        while group.lock().waiting.len() < queued.len() {
            tokio::task::yield_now().await;
        }
        release.notify_waiters();
        let answers = async {
            assert_eq!(first.await.expect("task"), None);
            for (i, task) in (1..50).zip(queued) {
                assert_eq!(task.await.expect("task"), Some(i * 2));
            }
        };
        // A hang guard, not a timing assertion: a stranded write never answers.
        tokio::time::timeout(Duration::from_secs(60), answers)
            .await
            .expect("every queued write answered");
        assert!(!group.lock().writing, "the writer stopped");
    }
}
