//! `idemkey`: parses the command line, wires the parts, reports errors.

use clap::Parser;
use idemkey_server::cli::{Cli, Command};
use idemkey_server::gateway::GatewayOptions;
use idemkey_server::outbox::OutboxOptions;
use idemkey_server::secret::{KeySecretSource, check_before_start, check_given};
use idemkey_server::{
    Database, ServeOptions, connect, keys, open_existing, serve, serve_with, with_store,
};
use idemkey_tower::InFlightPolicy;
use tracing_subscriber::EnvFilter;

const DEFAULT_WAIT: std::time::Duration = InFlightPolicy::DEFAULT_WAIT;

// mimalloc rather than the system allocator: under load glibc's malloc spent a large share
// of the server's CPU consolidating and unlinking chunks; see docs/decisions.md, "mimalloc,
// and the runtime's defaults".
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    // The demo prints a table: its embedded server and proxy log only errors there, unless
    // RUST_LOG asks for more.
    let default_filter = match cli.command {
        Command::Demo(_) => "error",
        _ => "info",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter)),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = run(cli).await {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Serve(args) => {
            check_before_start(
                &args.db.database_url,
                &KeySecretSource::from(&args.secret),
                args.key_secret_in_database,
            )?;
            let options = ServeOptions::try_from(&args)?;
            // Under `reject`, SQLite still waits for its single write lock (the default busy
            // time-out): refusing at once would refuse every concurrent write, any key.
            let lock_wait = match options.in_flight {
                InFlightPolicy::Wait(bound) => bound,
                InFlightPolicy::Reject => idemkey_sqlite::SqliteStore::DEFAULT_BUSY_TIMEOUT,
            };
            let url = args.db.database_url.clone();
            if url.starts_with("postgres://") || url.starts_with("postgresql://") {
                // A database server may come up after us: serve 503 until it answers.
                let max_connections = args.db.max_connections;
                serve_with(
                    move || {
                        let url = url.clone();
                        async move {
                            match connect(&url, max_connections, lock_wait).await? {
                                Database::Postgres(store) => Ok(store),
                                Database::Sqlite(_) => {
                                    anyhow::bail!("not a PostgreSQL URL")
                                }
                            }
                        }
                    },
                    options,
                )
                .await
            } else {
                let db = connect(&url, args.db.max_connections, lock_wait).await?;
                with_store!(db, store => serve(store, options).await)
            }
        }
        Command::Gateway(args) => {
            check_before_start(
                &args.database_url,
                &KeySecretSource::from(&args.secret),
                args.key_secret_in_database,
            )?;
            let options = GatewayOptions::try_from(&args)?;
            let db = connect(
                &args.database_url,
                args.max_connections,
                idemkey_sqlite::SqliteStore::DEFAULT_BUSY_TIMEOUT,
            )
            .await?;
            with_store!(db, store => idemkey_server::gateway::gateway(store, options).await)
        }
        Command::Migrate(db_args) => {
            let db = connect(&db_args.database_url, db_args.max_connections, DEFAULT_WAIT).await?;
            with_store!(db, store => idemkey_server::AppDb::migrate_all(&store).await)?;
            println!("migrations are up to date");
            Ok(())
        }
        Command::Bench(args) => {
            let json = args.json;
            let report = idemkey_server::bench::bench(idemkey_server::bench::BenchOptions {
                url: args.url.trim_end_matches('/').to_owned(),
                path: args.path,
                baseline_path: args.baseline_path,
                effects_path: args.effects_path,
                token: args.token,
                mode: args.mode.into(),
                concurrency: args.concurrency,
                requests: args.requests,
                duration: args.duration,
                race_width: args.race_width,
                replay_ratio: args.replay_ratio,
                mismatch_ratio: args.mismatch_ratio,
                unkeyed_ratio: args.unkeyed_ratio,
                run_id: args.run_id,
                server_pid: args.server_pid,
                database_pid: args.database_pid,
                json,
            })
            .await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", report.table());
            }
            if report.found_duplicates() {
                anyhow::bail!("duplicates found: an operation ran more than once");
            }
            Ok(())
        }
        Command::Check(args) => std::process::exit(idemkey_server::check::command(&args).await),
        Command::Demo(args) => {
            if !(0.0..=1.0).contains(&args.loss) {
                anyhow::bail!("--loss must be between 0.0 and 1.0");
            }
            println!(
                "Sending {} payments through a proxy that loses {:.0}% of responses after the server answered.",
                args.payments,
                args.loss * 100.0
            );
            let report = idemkey_server::demo::run(idemkey_server::demo::DemoOptions {
                operations: args.payments,
                loss: args.loss,
                concurrency: args.concurrency,
                database_url: args.database_url,
                seed: args.seed,
                quiet: false,
                late: args.late,
            })
            .await?;
            print!("{}", report.render());
            if !report.is_exact() {
                std::process::exit(2);
            }
            Ok(())
        }
        Command::Relay(args) => {
            let url = &args.db.database_url;
            let db = open_existing(url, args.db.max_connections, DEFAULT_WAIT).await?;
            let options = OutboxOptions::try_from(&args.outbox)?;
            with_store!(db, store => idemkey_server::outbox::relay(store, options, args.listen).await)
        }
        Command::Outbox(command) => {
            let (db_args, action) = command.into_parts();
            let url = db_args.database_url;
            let db = open_existing(&url, db_args.max_connections, DEFAULT_WAIT).await?;
            let mut out = std::io::stdout().lock();
            with_store!(db, store => idemkey_server::outbox::run(store, action, &mut out).await)
        }
        Command::Keys(command) => {
            let (db_args, secret, action) = command.into_parts();
            check_given(&secret)?;
            // Operator commands create nothing: no file, no tables, no secret.
            let url = db_args.database_url;
            let db = open_existing(&url, db_args.max_connections, DEFAULT_WAIT).await?;
            let mut out = std::io::stdout().lock();
            with_store!(db, store => keys::run(store, &url, &secret, action, &mut out).await)
        }
    }
}
