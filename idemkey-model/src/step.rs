//! The transitions: which actions a state enables, and what each does, with a readable note
//! for traces. Every decision goes through [`ClaimModel::decisions`].

use std::time::Duration;

use idemkey_core::{AfterEffect, Decision, FirstSentPolicy, Progress, RecordState};

use crate::state::{Answer, Body, Owner, Reply, Request, State};
use crate::store::Releaser;
use crate::{
    Action, ClaimModel, Commit, Lookup, Mode, NOW, RETENTION, Resolver, Upstream, fingerprint,
    first_sent_of, to_record,
};

impl ClaimModel {
    fn marked_at_reservation(&self) -> bool {
        matches!(
            self.config.mode,
            Mode::External {
                point_of_no_return_at_reservation: true
            }
        )
    }

    /// The state a fresh external claim writes.
    fn claimed_state(&self) -> RecordState {
        if self.marked_at_reservation() {
            RecordState::Executing
        } else {
            RecordState::Reserved
        }
    }

    /// Whether the record is in doubt, as the reconciler's listing and `resolve` tell it.
    fn in_doubt(&self, s: &State) -> bool {
        s.record.as_ref().is_some_and(|rec| {
            let record = to_record(rec, self.config.first_sent);
            matches!(
                (self.decisions.decide)(Some(&record), &record.fingerprint, record.first_sent, NOW),
                Decision::OutcomeUnknown { .. }
            )
        })
    }

    pub(crate) fn enabled(&self, s: &State, out: &mut Vec<Action>) {
        let c = &self.config;
        let external = matches!(c.mode, Mode::External { .. });
        // Idle owners are alike: the first serves.
        if let Some(owner) = s.owners.iter().position(|o| *o == Owner::Idle) {
            for (client, state) in s.clients.iter().enumerate() {
                if state.waiting_on.is_none() && state.attempts_left > 0 {
                    out.push(Action::Attempt {
                        client: client as u8,
                        owner: owner as u8,
                    });
                }
            }
        }
        for (i, owner) in s.owners.iter().enumerate() {
            let o = i as u8;
            match owner {
                Owner::Idle => continue,
                Owner::Claimed { bound_passed, .. } => {
                    out.push(Action::Send(o));
                    out.push(Action::ConnectRefused(o));
                    out.push(Action::Renew(o));
                    if self.marked_at_reservation() && !bound_passed {
                        out.push(Action::BoundPasses(o));
                    }
                }
                Owner::Sent { .. } => {
                    out.push(Action::Renew(o));
                    out.push(Action::TimeOut(o));
                }
                Owner::Decided { .. } => {
                    out.push(Action::Write {
                        owner: o,
                        answer_lost: false,
                    });
                    if s.losses_left > 0 {
                        out.push(Action::Write {
                            owner: o,
                            answer_lost: true,
                        });
                    }
                }
                Owner::InTransaction { .. } => {
                    for &outcome in &c.upstream {
                        for captured in [true, false] {
                            if !captured && !c.answers_too_large {
                                continue;
                            }
                            for commit in [Commit::Answered, Commit::LostAfter, Commit::LostBefore]
                            {
                                if commit != Commit::Answered && s.losses_left == 0 {
                                    continue;
                                }
                                out.push(Action::Handle {
                                    owner: o,
                                    outcome,
                                    captured,
                                    commit,
                                });
                            }
                        }
                    }
                }
            }
            if s.crashes_left > 0 {
                out.push(Action::Crash(o));
            }
        }
        for request in 0..s.requests.len() {
            for &outcome in &c.upstream {
                out.push(Action::Deliver { request, outcome });
            }
            if s.losses_left > 0 {
                out.push(Action::LoseRequest(request));
            }
        }
        for reply in 0..s.replies.len() {
            out.push(Action::Receive {
                reply,
                captured: true,
            });
            if c.answers_too_large {
                out.push(Action::Receive {
                    reply,
                    captured: false,
                });
            }
            if s.losses_left > 0 {
                out.push(Action::LoseReply(reply));
            }
        }
        if let Some(rec) = &s.record {
            if external
                && rec.lease_live
                && matches!(rec.state, RecordState::Reserved | RecordState::Executing)
            {
                out.push(Action::LeaseLapses);
            }
            if c.retention_ends && !rec.expired && (s.late || !c.first_sent) {
                out.push(Action::RetentionEnds);
            }
            if rec.expired && s.lock.is_none() {
                out.push(Action::Purge);
            }
        }
        if c.first_sent && !s.late {
            out.push(Action::Late);
        }
        if external && self.in_doubt(s) {
            for (on, by) in [
                (c.reconciler, Resolver::Reconciler),
                (c.operator, Resolver::Operator),
            ] {
                if !on {
                    continue;
                }
                out.push(Action::Resolve { by, captured: true });
                if by == Resolver::Reconciler && c.answers_too_large {
                    out.push(Action::Resolve {
                        by,
                        captured: false,
                    });
                }
            }
        }
    }

    /// The state after `action`, and what happened, in words; `None` when it changes nothing.
    pub(crate) fn step(&self, s: &State, action: Action) -> Option<(State, String)> {
        let mut s = s.clone();
        let note = match action {
            Action::Attempt { client, owner } => self.attempt(&mut s, client, owner),
            Action::Send(o) => self.send(&mut s, o)?,
            Action::ConnectRefused(o) => {
                let Owner::Claimed {
                    client,
                    generation,
                    token,
                    ..
                } = s.owners[usize::from(o)]
                else {
                    return None;
                };
                let progress = (self.decisions.owner_progress)(false, false, Some(503));
                let write = (self.decisions.after_effect)(progress, &self.config.rule);
                s.owners[usize::from(o)] = Owner::Decided {
                    client,
                    generation,
                    token,
                    write,
                    store: None,
                    released_by_answer: false,
                    answer: Answer::Unavailable,
                };
                format!(
                    "owner {o}: the upstream refuses the connection, nothing sent; decides {write}"
                )
            }
            Action::Renew(o) => {
                let (token, generation) = match s.owners[usize::from(o)] {
                    Owner::Claimed {
                        token, generation, ..
                    }
                    | Owner::Sent {
                        token, generation, ..
                    } => (token, generation),
                    _ => return None,
                };
                // A renewal of a live lease changes nothing the model tells apart.
                let live = s.record.as_ref().is_some_and(|r| r.lease_live);
                if live {
                    return None;
                }
                let matched = s.owned_write(token, generation, |rec| {
                    if matches!(rec.state, RecordState::Reserved | RecordState::Executing) {
                        rec.lease_live = true;
                    }
                });
                if !matched {
                    return None;
                }
                format!("owner {o}: renews its lease (token {token})")
            }
            Action::Deliver { request, outcome } => {
                let req = s.requests.remove(request);
                let execution = outcome.executes().then(|| {
                    s.executions.push(req.body);
                    (s.executions.len() - 1) as u8
                });
                if let Some(owner) = req.owner {
                    s.replies.push(Reply {
                        owner,
                        status: outcome.status(),
                        execution,
                    });
                    s.replies.sort();
                }
                match execution {
                    Some(e) => format!(
                        "upstream: executes body {:?} as execution #{e}, answers {}",
                        req.body,
                        outcome.status()
                    ),
                    None => format!(
                        "upstream: refuses body {:?} before any effect, answers {}",
                        req.body,
                        outcome.status()
                    ),
                }
            }
            Action::LoseRequest(i) => {
                let req = s.requests.remove(i);
                s.losses_left -= 1;
                format!(
                    "network: the request (body {:?}) to the upstream is lost",
                    req.body
                )
            }
            Action::Receive { reply, captured } => self.receive(&mut s, reply, captured)?,
            Action::LoseReply(i) => {
                let reply = s.replies.remove(i);
                s.losses_left -= 1;
                format!(
                    "network: the upstream's answer {} to owner {} is lost",
                    reply.status, reply.owner
                )
            }
            Action::TimeOut(o) => {
                let Owner::Sent {
                    client,
                    generation,
                    token,
                } = s.owners[usize::from(o)]
                else {
                    return None;
                };
                stop_waiting(&mut s, o);
                let progress = (self.decisions.owner_progress)(true, true, Some(504));
                let write = (self.decisions.after_effect)(progress, &self.config.rule);
                s.owners[usize::from(o)] = Owner::Decided {
                    client,
                    generation,
                    token,
                    write,
                    store: None,
                    released_by_answer: false,
                    answer: Answer::OutcomeUnknown,
                };
                format!(
                    "owner {o}: times out waiting for the upstream ({progress:?}); decides {write}"
                )
            }
            Action::Write { owner, answer_lost } => self.write(&mut s, owner, answer_lost)?,
            Action::Handle {
                owner,
                outcome,
                captured,
                commit,
            } => self.handle(&mut s, owner, outcome, captured, commit)?,
            Action::Crash(o) => {
                s.crashes_left -= 1;
                stop_waiting(&mut s, o);
                if s.lock == Some(o) {
                    s.lock = None;
                }
                for client in &mut s.clients {
                    if client.waiting_on == Some(o) {
                        client.waiting_on = None;
                    }
                }
                s.owners[usize::from(o)] = Owner::Idle;
                format!(
                    "owner {o}: crashes (its transaction, if any, rolls back; its client's connection drops)"
                )
            }
            Action::LeaseLapses => {
                let rec = s.record.as_mut()?;
                rec.lease_live = false;
                let generation = rec.generation;
                for owner in &mut s.owners {
                    if let Owner::Claimed {
                        generation: g,
                        bound_passed,
                        ..
                    } = owner
                        && *g == generation
                    {
                        // Its own reservation's lease ends no later than the record's.
                        *bound_passed = true;
                    }
                }
                "clock: the record's lease lapses".to_owned()
            }
            Action::BoundPasses(o) => {
                let Owner::Claimed { bound_passed, .. } = &mut s.owners[usize::from(o)] else {
                    return None;
                };
                *bound_passed = true;
                format!("clock: owner {o}'s reservation lease passes on its clock")
            }
            Action::Late => {
                s.late = true;
                "clock: the first attempts' time is now past the retention less the margin"
                    .to_owned()
            }
            Action::RetentionEnds => {
                s.record.as_mut()?.expired = true;
                s.retention_ended = true;
                "clock: the record's retention ends".to_owned()
            }
            Action::Purge => {
                s.record = None;
                "purge: deletes the expired record".to_owned()
            }
            Action::Resolve { by, captured } => self.resolve(&mut s, by, captured)?,
        };
        Some((s, note))
    }

    fn attempt(&self, s: &mut State, client: u8, owner: u8) -> String {
        let c = &self.config;
        let body = c.clients[usize::from(client)];
        let who = format!("client {client} (body {body:?}) via owner {owner}");
        s.clients[usize::from(client)].attempts_left -= 1;
        let first_sent = c.first_sent.then(|| first_sent_of(body));
        let late = first_sent.is_some_and(|sent| {
            let now = if s.late {
                sent.plus(RETENTION)
            } else {
                sent.plus(Duration::from_secs(1))
            };
            (self.decisions.is_late)(&FirstSentPolicy::default(), sent, now, RETENTION)
        });
        let local = c.mode == Mode::Local;
        if local && s.lock.is_some() {
            return self.answer(s, client, Answer::InFlight, &who, "the key's row is locked");
        }
        let existing = s.record.as_ref().map(|r| to_record(r, c.first_sent));
        let decision =
            (self.decisions.decide)(existing.as_ref(), &fingerprint(body), first_sent, NOW);
        let claim_note = if late { "looks up (late)" } else { "claims" };
        match decision {
            Decision::Execute | Decision::TakeOver { .. } if late => self.answer(
                s,
                client,
                Answer::FirstSentExpired,
                &who,
                "no live record for a late retry",
            ),
            Decision::Execute if local => {
                s.lock = Some(owner);
                self.serve(s, client, owner, Owner::InTransaction { client, body });
                format!("{who}: {claim_note}: no record, begins the claim's transaction")
            }
            Decision::TakeOver { token } if local => {
                s.lock = Some(owner);
                self.serve(s, client, owner, Owner::InTransaction { client, body });
                format!("{who}: takes over the expired record (token {token}) in its transaction")
            }
            Decision::Execute => match s.insert(body, self.claimed_state(), c.insert_token) {
                Some((generation, token)) => {
                    self.serve(s, client, owner, claimed(client, body, generation, token));
                    format!(
                        "{who}: inserts the record ({}, token {token})",
                        self.claimed_state()
                    )
                }
                None => self.answer(s, client, Answer::InFlight, &who, "insert conflicts"),
            },
            Decision::TakeOver { token } => match s.replace(token, body, self.claimed_state()) {
                Some((generation, token)) => {
                    self.serve(s, client, owner, claimed(client, body, generation, token));
                    format!(
                        "{who}: takes the record over ({}, token {token})",
                        self.claimed_state()
                    )
                }
                None => self.answer(s, client, Answer::InFlight, &who, "takeover fenced"),
            },
            Decision::Replay(response) => {
                let answer = match response.body.first() {
                    Some(&execution) => Answer::Executed {
                        status: response.status,
                        execution,
                    },
                    None => Answer::NotExecuted(response.status),
                };
                self.answer(s, client, answer, &who, "replay")
            }
            Decision::Mismatch(_) => self.answer(s, client, Answer::Mismatch, &who, "mismatch"),
            Decision::InFlight { .. } => {
                self.answer(s, client, Answer::InFlight, &who, "in flight")
            }
            Decision::OutcomeUnknown { mark_indeterminate } => {
                let mut how = "outcome unknown".to_owned();
                if let Some(token) = mark_indeterminate
                    && let Some(rec) = s.record.as_mut().filter(|r| r.token == token)
                {
                    State::mark_indeterminate(rec);
                    how = format!(
                        "lease lapsed after the point of no return: marks it indeterminate (token {token})"
                    );
                }
                self.answer(s, client, Answer::OutcomeUnknown, &who, &how)
            }
        }
    }

    /// `client` is answered `answer` at once, without a claim.
    fn answer(&self, s: &mut State, client: u8, answer: Answer, who: &str, why: &str) -> String {
        self.hear(s, client, answer);
        format!("{who}: {why}; answered {answer}")
    }

    /// `client` gets `answer`. `one_answer`: an execution's answer reaches only clients of
    /// its own body, and all of a body's clients get the same execution's (unless
    /// executions may repeat); every other [`Answer`] is a documented refusal, in-flight or
    /// outcome-unknown answer.
    fn hear(&self, s: &mut State, client: u8, answer: Answer) {
        let Answer::Executed { execution, .. } = answer else {
            return;
        };
        let body = self.config.clients[usize::from(client)];
        if s.executions.get(usize::from(execution)) != Some(&body) {
            s.breaches.other_answer = true;
        }
        let repeats = self.repeats_allowed(s);
        let slot = &mut s.answered[body as usize];
        if slot.is_some_and(|e| e != execution) && !repeats {
            s.breaches.other_answer = true;
        }
        *slot = Some(execution);
    }

    fn serve(&self, s: &mut State, client: u8, owner: u8, state: Owner) {
        s.clients[usize::from(client)].waiting_on = Some(owner);
        s.owners[usize::from(owner)] = state;
    }

    fn send(&self, s: &mut State, o: u8) -> Option<String> {
        let Owner::Claimed {
            client,
            body,
            generation,
            token,
            bound_passed,
        } = s.owners[usize::from(o)]
        else {
            return None;
        };
        let passed = if self.marked_at_reservation() {
            // `Lease::point_of_no_return` writes nothing, and refuses once the
            // reservation's own lease passed on this owner's clock.
            !bound_passed
        } else {
            s.owned_write(token, generation, |rec| {
                rec.state = RecordState::Executing;
                rec.lease_live = true;
            })
        };
        if !passed {
            let progress = (self.decisions.owner_progress)(false, false, Some(409));
            let write = (self.decisions.after_effect)(progress, &self.config.rule);
            s.owners[usize::from(o)] = Owner::Decided {
                client,
                generation,
                token,
                write,
                store: None,
                released_by_answer: false,
                answer: Answer::InFlight,
            };
            return Some(format!(
                "owner {o}: the point of no return is refused (fenced), nothing sent; decides {write}"
            ));
        }
        if let Some(rec) = s.record.as_mut().filter(|r| r.generation == generation) {
            rec.sent = true;
        }
        s.requests.push(Request {
            owner: Some(o),
            body,
        });
        s.requests.sort();
        s.owners[usize::from(o)] = Owner::Sent {
            client,
            generation,
            token,
        };
        Some(format!(
            "owner {o}: passes the point of no return (token {token}); the request (body {body:?}) leaves"
        ))
    }

    fn receive(&self, s: &mut State, i: usize, captured: bool) -> Option<String> {
        let reply = s.replies[i].clone();
        let o = reply.owner;
        let Owner::Sent {
            client,
            generation,
            token,
        } = s.owners[usize::from(o)]
        else {
            return None;
        };
        let progress = (self.decisions.owner_progress)(true, false, Some(reply.status));
        let mut write = (self.decisions.after_effect)(progress, &self.config.rule);
        let mut answer = match reply.execution {
            Some(execution) => Answer::Executed {
                status: reply.status,
                execution,
            },
            None => Answer::NotExecuted(reply.status),
        };
        let mut store = None;
        let mut how = String::new();
        if write == AfterEffect::Complete {
            if captured {
                store = Some((reply.status, reply.execution));
            } else {
                write = (self.decisions.answer_not_captured)(progress);
                answer = Answer::TooLarge;
                how = " (too large to store)".to_owned();
            }
        } else if !captured {
            return None;
        }
        s.replies.remove(i);
        s.owners[usize::from(o)] = Owner::Decided {
            client,
            generation,
            token,
            write,
            store,
            released_by_answer: write == AfterEffect::Release,
            answer,
        };
        Some(format!(
            "owner {o}: receives the upstream's answer {}{how}; decides {write}",
            reply.status
        ))
    }

    fn write(&self, s: &mut State, o: u8, answer_lost: bool) -> Option<String> {
        let Owner::Decided {
            client,
            generation,
            token,
            write,
            store,
            released_by_answer,
            answer,
        } = s.owners[usize::from(o)]
        else {
            return None;
        };
        let matched = match write {
            AfterEffect::Complete => {
                let response = store?;
                s.owned_write(token, generation, |rec| State::complete(rec, response))
            }
            AfterEffect::Indeterminate => {
                s.owned_write(token, generation, State::mark_indeterminate)
            }
            AfterEffect::Release => {
                let matched = s.owned_write(token, generation, |_| {});
                if matched {
                    let by = if released_by_answer {
                        Releaser::OwnerAfterRefusal
                    } else {
                        Releaser::Owner
                    };
                    s.delete(by, Some(generation));
                }
                matched
            }
        };
        s.owners[usize::from(o)] = Owner::Idle;
        let outcome = if matched {
            "done"
        } else {
            "fenced, changes nothing"
        };
        let mut note = format!("owner {o}: writes {write} with token {token} ({outcome})");
        let c = &mut s.clients[usize::from(client)];
        if c.waiting_on == Some(o) {
            c.waiting_on = None;
            if answer_lost {
                s.losses_left -= 1;
                note.push_str(&format!("; its answer to client {client} is lost"));
            } else {
                self.hear(s, client, answer);
                note.push_str(&format!("; client {client} gets {answer}"));
            }
        } else if answer_lost {
            return None;
        }
        Some(note)
    }

    fn handle(
        &self,
        s: &mut State,
        o: u8,
        outcome: Upstream,
        captured: bool,
        commit: Commit,
    ) -> Option<String> {
        let Owner::InTransaction { client, body } = s.owners[usize::from(o)] else {
            return None;
        };
        let status = outcome.status();
        let decision = (self.decisions.local_after_effect)(status, captured, &self.config.rule);
        s.owners[usize::from(o)] = Owner::Idle;
        s.lock = None;
        let answer = match decision {
            AfterEffect::Complete => {
                if commit != Commit::LostBefore {
                    let execution = outcome.executes().then(|| {
                        s.executions.push(body);
                        (s.executions.len() - 1) as u8
                    });
                    // The claim's row (inserted, or the expired one replaced) commits
                    // completed with the effect.
                    s.record = None;
                    s.insert(body, RecordState::Completed, self.config.insert_token);
                    if let Some(rec) = s.record.as_mut() {
                        rec.response = Some((status, execution));
                    }
                    match (commit, execution) {
                        (Commit::Answered, Some(execution)) => {
                            Answer::Executed { status, execution }
                        }
                        (Commit::Answered, None) => Answer::NotExecuted(status),
                        _ => Answer::OutcomeUnknown,
                    }
                } else {
                    Answer::OutcomeUnknown
                }
            }
            // Rolled back: the effect and the claim together.
            _ if commit != Commit::Answered => return None,
            _ if !captured => Answer::TooLarge,
            _ => Answer::NotExecuted(status),
        };
        if commit != Commit::Answered {
            s.losses_left -= 1;
        }
        let c = &mut s.clients[usize::from(client)];
        let got = if c.waiting_on == Some(o) {
            c.waiting_on = None;
            self.hear(s, client, answer);
            format!("client {client} gets {answer}")
        } else {
            "its client stopped waiting".to_owned()
        };
        Some(format!(
            "owner {o}: the handler answers {status}{}; {decision}, commit {commit:?}; {got}",
            if captured {
                ""
            } else {
                " (too large to store)"
            }
        ))
    }

    fn resolve(&self, s: &mut State, by: Resolver, captured: bool) -> Option<String> {
        let rec = s.record.as_ref()?;
        let key_executions = s.executions.len();
        let on_its_way = !s.requests.is_empty();
        let status = if key_executions > 0 {
            200
        } else if self.config.lookup == Lookup::Settled && on_its_way {
            503
        } else {
            404
        };
        let latest = key_executions.checked_sub(1).map(|e| e as u8);
        let token = rec.token;
        let mut effect = (self.decisions.reconciled)(status);
        if effect == AfterEffect::Complete && !captured {
            effect = (self.decisions.answer_not_captured)(Progress::Answered(status));
        } else if !captured {
            return None;
        }
        let how = match effect {
            AfterEffect::Indeterminate => return None,
            AfterEffect::Complete => {
                let rec = s.record.as_mut()?;
                State::complete(rec, (status, latest));
                "completes it with the look-up's answer"
            }
            AfterEffect::Release => {
                let releaser = if status == 404 {
                    Releaser::Truth(by)
                } else {
                    Releaser::Resolver(by)
                };
                s.delete(releaser, None);
                "releases the key"
            }
        };
        Some(format!(
            "{by:?}: the record is in doubt; the look-up answers {status}{}; {how} (token {token})",
            if captured { "" } else { " (too large)" }
        ))
    }
}

fn claimed(client: u8, body: Body, generation: u8, token: i64) -> Owner {
    Owner::Claimed {
        client,
        body,
        generation,
        token,
        bound_passed: false,
    }
}

/// The owner `o` stops waiting for the upstream: its requests still go, their answers are
/// for nobody.
fn stop_waiting(s: &mut State, o: u8) {
    for req in &mut s.requests {
        if req.owner == Some(o) {
            req.owner = None;
        }
    }
    s.requests.sort();
    s.replies.retain(|r| r.owner != o);
}
