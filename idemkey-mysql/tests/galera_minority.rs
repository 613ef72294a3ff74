//! The MySQL store on a Galera node left without a majority (a non-primary component): the
//! node refuses every statement (error 1047) until it rejoins, so a store there takes no
//! claim, and the error is one the layer answers as 503 `store-unavailable` (not `Busy`, which
//! would say another attempt holds the key). A cluster of its own: the test kills two of its
//! three nodes.

use idemkey_core::{Store, StoreError};
use idemkey_mysql::MySqlStore;
use idemkey_testkit::GaleraCluster;

#[tokio::test(flavor = "multi_thread")]
async fn a_node_without_a_majority_takes_no_claim_and_says_unavailable() {
    let mut cluster = tokio::task::spawn_blocking(|| GaleraCluster::start(3))
        .await
        .expect("cluster");
    let urls = tokio::task::block_in_place(|| cluster.fresh_database());
    let store = MySqlStore::connect(&urls[0], 4).await.expect("connect");
    store.migrate().await.expect("migrate");
    let tx = store
        .begin()
        .await
        .expect("begin on a node of the majority");
    store.commit(tx).await.expect("commit");

    // Node 0 alone of three is a minority: it leaves the primary component.
    tokio::task::block_in_place(|| {
        cluster.kill9(1);
        cluster.kill9(2);
    });
    let status =
        tokio::task::block_in_place(|| cluster.query(0, "SHOW STATUS LIKE 'wsrep_cluster_status'"))
            .expect("status");
    assert_eq!(status, "wsrep_cluster_status\tnon-Primary");

    match store.begin().await {
        Err(StoreError::Database(_) | StoreError::Unavailable(_)) => {}
        Err(other) => panic!("a minority's refusal must not read as {other:?}"),
        Ok(_) => panic!("a node without a majority began a transaction"),
    }
}
