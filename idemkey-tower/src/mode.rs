//! The layer's two modes, as types: [`Local`] (the handler takes a [`Tx`](crate::Tx)) and
//! [`External`] (the handler takes an [`External`](crate::External) handle). A layer starts
//! local; [`IdempotencyLayer::external`](crate::IdempotencyLayer::external) turns it into
//! `IdempotencyLayer<S, mode::External>`, and only that type has the external mode's
//! settings.
//!
//! A route built with [`IdempotencyLayer::handler`](crate::IdempotencyLayer::handler) has
//! its handler's extractors checked against the mode when the router is built: a `Tx` on an
//! external route, or an `External` on a local one, panics there instead of answering 500
//! `transaction-unavailable` to every request.

use std::any::TypeId;
use std::time::Duration;

use idemkey_core::Store;

use crate::IdempotencyRejection;
use crate::layer::KeySeal;

/// Local mode: the claim, the handler's effect (on its [`Tx`](crate::Tx)) and the stored
/// answer share one transaction of the store.
#[derive(Debug, Clone, Copy, Default)]
pub struct Local;

/// External mode: the claim commits at once as a reservation with a lease, and the handler
/// takes an [`External`](crate::External) handle (see
/// [`IdempotencyLayer::external`](crate::IdempotencyLayer::external)).
#[derive(Debug, Clone)]
pub struct External {
    pub(crate) lease: Duration,
    /// The reservation marks the point of no return.
    pub(crate) marked_at_reservation: bool,
    /// Seals the raw key into the record, for a reconciler.
    pub(crate) seal: Option<KeySeal>,
}

impl External {
    pub(crate) fn new(lease: Duration) -> Self {
        Self {
            lease,
            marked_at_reservation: false,
            seal: None,
        }
    }
}

/// A mode of [`IdempotencyLayer`](crate::IdempotencyLayer): [`Local`] or [`External`].
pub trait Mode: sealed::Mode + Clone + Send + Sync + 'static {}

impl Mode for Local {}
impl Mode for External {}

/// The extractors of an axum handler (the `T` of its `Handler<T, _>`), which
/// [`IdempotencyLayer::handler`](crate::IdempotencyLayer::handler) checks against the mode.
/// Implemented for every handler function of up to 16 arguments.
pub trait Extractors: sealed::Extractors + 'static {}

pub(crate) mod sealed {
    use super::*;

    pub trait Mode {
        /// The external mode's settings; `None` in local mode.
        fn external(&self) -> Option<&External>;

        /// The extractors a handler of this mode cannot take, with what to say of each.
        fn refused<S: Store>() -> Vec<(TypeId, &'static str)>;
    }

    pub trait Extractors {
        /// The type of each extractor.
        fn types() -> Vec<TypeId>;
    }

    impl Mode for Local {
        fn external(&self) -> Option<&External> {
            None
        }

        fn refused<S: Store>() -> Vec<(TypeId, &'static str)> {
            const SAY: &str = "takes an `External`, which only a route in external mode \
                               gives: turn the layer external with `.external(lease)`, or \
                               take a `Tx`";
            vec![
                (TypeId::of::<crate::External<S>>(), SAY),
                (TypeId::of::<Option<crate::External<S>>>(), SAY),
                (
                    TypeId::of::<Result<crate::External<S>, IdempotencyRejection>>(),
                    SAY,
                ),
            ]
        }
    }

    impl Mode for External {
        fn external(&self) -> Option<&External> {
            Some(self)
        }

        fn refused<S: Store>() -> Vec<(TypeId, &'static str)> {
            const SAY: &str = "takes a `Tx`, which a route in external mode does not give \
                               (its claim commits before the handler runs): take an \
                               `External`, or drop `.external(lease)`";
            vec![
                (TypeId::of::<crate::Tx<S>>(), SAY),
                (
                    TypeId::of::<Result<crate::Tx<S>, IdempotencyRejection>>(),
                    SAY,
                ),
            ]
        }
    }

    impl Extractors for ((),) {
        fn types() -> Vec<TypeId> {
            Vec::new()
        }
    }

    macro_rules! extractors {
        ($($ty:ident),*) => {
            impl<M: 'static, $($ty: 'static,)*> Extractors for (M, $($ty,)*) {
                fn types() -> Vec<TypeId> {
                    vec![$(TypeId::of::<$ty>(),)*]
                }
            }
            impl<M: 'static, $($ty: 'static,)*> super::Extractors for (M, $($ty,)*) {}
        };
    }

    extractors!(T1);
    extractors!(T1, T2);
    extractors!(T1, T2, T3);
    extractors!(T1, T2, T3, T4);
    extractors!(T1, T2, T3, T4, T5);
    extractors!(T1, T2, T3, T4, T5, T6);
    extractors!(T1, T2, T3, T4, T5, T6, T7);
    extractors!(T1, T2, T3, T4, T5, T6, T7, T8);
    extractors!(T1, T2, T3, T4, T5, T6, T7, T8, T9);
    extractors!(T1, T2, T3, T4, T5, T6, T7, T8, T9, T10);
    extractors!(T1, T2, T3, T4, T5, T6, T7, T8, T9, T10, T11);
    extractors!(T1, T2, T3, T4, T5, T6, T7, T8, T9, T10, T11, T12);
    extractors!(T1, T2, T3, T4, T5, T6, T7, T8, T9, T10, T11, T12, T13);
    extractors!(T1, T2, T3, T4, T5, T6, T7, T8, T9, T10, T11, T12, T13, T14);
    extractors!(
        T1, T2, T3, T4, T5, T6, T7, T8, T9, T10, T11, T12, T13, T14, T15
    );
    extractors!(
        T1, T2, T3, T4, T5, T6, T7, T8, T9, T10, T11, T12, T13, T14, T15, T16
    );
}

impl Extractors for ((),) {}
