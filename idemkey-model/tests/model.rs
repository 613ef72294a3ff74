//! The model check: each bounded configuration explored exhaustively, every property held;
//! deliberately wrong decisions, and the assumptions the proof rests on, each shown to break
//! a property with its shortest trace.

use std::collections::BTreeSet;
use std::io::Write;
use std::time::Instant;

use idemkey_core::{AfterEffect, Progress, after_effect, answer_not_captured};
use idemkey_model::{ClaimModel, Config, Decisions, InsertToken, Lookup, Mode};
use stateright::{Checker, HasDiscoveries, Model};

/// Explores `config` exhaustively with `decisions` and asserts every property.
fn holds(name: &str, config: Config) {
    let model = ClaimModel::new(config);
    let start = Instant::now();
    let checker = model.checker().threads(2).spawn_bfs().join();
    // Straight to stderr, past the test harness's capture: the count shows in every run.
    let _ = writeln!(
        std::io::stderr(),
        "{name}: {} states ({} transitions), depth {}, in {:.1?}",
        checker.unique_state_count(),
        checker.state_count(),
        checker.max_depth(),
        start.elapsed()
    );
    assert!(checker.is_done(), "{name}: not explored whole");
    checker.assert_properties();
}

/// The shortest trace that breaks `property`, printed as readable steps: breadth first,
/// one thread, the depth raised one step at a time, so that the first trace found is one of
/// the shortest.
fn shortest_counterexample(name: &str, model: ClaimModel, property: &'static str) -> String {
    let start = Instant::now();
    for depth in 2..=40 {
        let checker = model
            .clone()
            .checker()
            .threads(1)
            .target_max_depth(depth)
            .finish_when(HasDiscoveries::AnyOf(BTreeSet::from([property])))
            .spawn_bfs()
            .join();
        if let Some(path) = checker.discovery(property) {
            let trace = model.explain(path);
            println!(
                "{name}: {property} broken in {} steps (found in {:.1?}):\n{trace}",
                trace.lines().count(),
                start.elapsed()
            );
            return trace;
        }
    }
    panic!("{name}: no counterexample for {property} within 40 steps");
}

#[test]
fn external_mode_holds_every_property() {
    holds(
        "external, point of no return at reservation",
        Config::external(),
    );
}

#[test]
fn external_mode_with_a_separate_point_of_no_return_holds_every_property() {
    holds(
        "external, separate point of no return",
        Config {
            mode: Mode::External {
                point_of_no_return_at_reservation: false,
            },
            ..Config::external()
        },
    );
}

#[test]
fn local_mode_holds_every_property() {
    holds("local", Config::local());
}

/// A store whose `INSERT` started every record at token 1: a record deleted (released by the
/// reconciler or an operator, purged) and claimed anew carries the token its first owner
/// held, and that owner, paused past its lease, then writes on the new claim. The stores
/// start each claim at a fresh token instead ([`InsertToken::Fresh`], the default).
#[test]
fn a_fixed_start_token_on_a_claim_anew_lets_a_stale_owner_write() {
    let model = ClaimModel::new(Config {
        insert_token: InsertToken::One,
        ..Config::external()
    });
    let trace = shortest_counterexample(
        "token 1 on every insert",
        model.clone(),
        "stale_owner_inert",
    );
    assert!(
        trace.contains("Reconciler") || trace.contains("Operator"),
        "{trace}"
    );
    shortest_counterexample("token 1 on every insert", model, "at_most_once");
}

/// `after_effect` turned wrong: a request that left and got no answer releases the key.
#[test]
fn releasing_a_sent_request_without_an_answer_executes_twice() {
    fn wrong(progress: Progress, rule: &idemkey_core::AnswerRule) -> AfterEffect {
        match progress {
            Progress::SentNoAnswer => AfterEffect::Release,
            other => after_effect(other, rule),
        }
    }
    let model = ClaimModel::new(Config::external()).with_decisions(Decisions {
        after_effect: wrong,
        ..Decisions::default()
    });
    let trace = shortest_counterexample(
        "after_effect: sent, no answer -> release",
        model,
        "at_most_once",
    );
    assert!(trace.contains("execution #1"), "{trace}");
}

/// `answer_not_captured` turned wrong: an answer too large to store, after the request
/// left, releases the key.
#[test]
fn releasing_a_sent_request_whose_answer_was_too_large_executes_twice() {
    fn wrong(progress: Progress) -> AfterEffect {
        match progress {
            Progress::NotSent | Progress::SentNoAnswer | Progress::Answered(_) => {
                AfterEffect::Release
            }
        }
    }
    // The real one releases before the point of no return only.
    assert_eq!(
        answer_not_captured(Progress::NotSent),
        wrong(Progress::NotSent)
    );
    let model = ClaimModel::new(Config::external()).with_decisions(Decisions {
        answer_not_captured: wrong,
        ..Decisions::default()
    });
    let trace = shortest_counterexample(
        "answer_not_captured: sent -> release",
        model,
        "at_most_once",
    );
    assert!(trace.contains("too large"), "{trace}");
}

/// The first-sent rule turned off: a retry after its record's retention runs again.
#[test]
fn a_late_retry_not_refused_executes_twice() {
    let model = ClaimModel::new(Config::external()).with_decisions(Decisions {
        is_late: |_, _, _, _| false,
        ..Decisions::default()
    });
    let trace = shortest_counterexample("is_late: never", model, "at_most_once");
    assert!(trace.contains("retention ends"), "{trace}");
}

/// The assumption the reconciler rests on: a look-up that says "not found" while the
/// request is still on its way lets that request run after a retry did.
#[test]
fn a_look_up_truthful_only_when_it_answers_lets_a_request_run_twice() {
    let model = ClaimModel::new(Config {
        lookup: Lookup::AtArrival,
        ..Config::external()
    });
    shortest_counterexample("look-up truthful at arrival only", model, "at_most_once");
}

/// A record in doubt is settled by the reconciler or an operator only.
#[test]
fn without_a_reconciler_or_an_operator_a_record_in_doubt_stays() {
    let model = ClaimModel::new(Config {
        reconciler: false,
        operator: false,
        retention_ends: false,
        ..Config::external()
    });
    let trace = shortest_counterexample("no reconciler, no operator", model, "settles");
    assert!(!trace.contains("Reconciler"), "{trace}");
}

/// Deeper bounds, for a release (`scripts/model_deep.sh`): `MODEL_CLIENTS` (e.g. `AAAB`),
/// `MODEL_ATTEMPTS`, `MODEL_CRASHES`, `MODEL_LOSSES`, each mode in turn.
#[test]
#[ignore = "minutes to hours: run by scripts/model_deep.sh"]
fn deep() {
    let var = |name: &str| std::env::var(name).ok();
    let mut base = Config::external();
    if let Some(clients) = var("MODEL_CLIENTS") {
        base.clients = clients
            .chars()
            .map(|c| match c {
                'A' => idemkey_model::Body::A,
                _ => idemkey_model::Body::B,
            })
            .collect();
    }
    let number = |name: &str, default: u8| var(name).map_or(default, |v| v.parse().expect(name));
    base.attempts = number("MODEL_ATTEMPTS", 3);
    base.crashes = number("MODEL_CRASHES", 1);
    base.losses = number("MODEL_LOSSES", 1);
    for (name, mode) in [
        ("deep external", base.mode),
        (
            "deep external, separate point of no return",
            Mode::External {
                point_of_no_return_at_reservation: false,
            },
        ),
        ("deep local", Mode::Local),
    ] {
        let local = mode == Mode::Local;
        holds(
            name,
            Config {
                mode,
                reconciler: !local,
                operator: !local,
                ..base.clone()
            },
        );
    }
}
