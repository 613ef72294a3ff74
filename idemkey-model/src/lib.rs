//! A model check of idemkey's claim protocol with stateright (being written).
