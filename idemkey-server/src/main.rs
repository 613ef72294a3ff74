//! `idemkey`: parses the command line, wires the parts, reports errors.

use clap::Parser;
use idemkey_server::check::{self, CheckOptions, ReportFiles};
use idemkey_server::cli::{Cli, Command, GatewayArgs, RelayArgs, ServeArgs};
use idemkey_server::gateway::GatewayOptions;
use idemkey_server::keys::{self, KeysAction};
use idemkey_server::outbox::{OutboxAction, OutboxOptions};
use idemkey_server::secret::{KeySecretSource, check_before_start, check_given};
use idemkey_server::{
    Backend, DatabaseOptions, OnDatabase, ServeOptions, open_existing, serve_on, with_database,
};
use idemkey_tower::InFlightPolicy;
use tracing_subscriber::EnvFilter;

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
        Command::Serve(args) => with_database(&args.db.database_url.clone(), Serve(args)).await,
        Command::Gateway(args) => with_database(&args.database_url.clone(), Gateway(args)).await,
        Command::Migrate(db) => {
            with_database(&db.database_url, Migrate((&db).into())).await?;
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
        Command::Check(args) => {
            let files = ReportFiles::from(&args);
            std::process::exit(check::command(CheckOptions::from(&args), &files).await)
        }
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
        Command::Relay(args) => with_database(&args.db.database_url.clone(), Relay(args)).await,
        Command::Outbox(command) => {
            let (db, action) = command.into_parts();
            with_database(&db.url.clone(), Outbox(db, action)).await
        }
        Command::Keys(command) => {
            let (db, secret, action) = command.into_parts();
            check_given(&secret)?;
            with_database(&db.url.clone(), Keys(db, secret, action)).await
        }
    }
}

/// `idemkey serve`.
struct Serve(ServeArgs);

impl OnDatabase for Serve {
    type Output = ();

    async fn run<S: Backend>(self) -> anyhow::Result<()> {
        let Self(args) = self;
        check_before_start::<S>(
            &args.db.database_url,
            &KeySecretSource::from(&args.secret),
            args.key_secret_in_database,
        )?;
        let options = ServeOptions::try_from(&args)?;
        let mut database = DatabaseOptions::from(&args.db);
        // Under `reject`, SQLite still waits for its single write lock (the default busy
        // time-out): refusing at once would refuse every concurrent write, any key.
        if let InFlightPolicy::Wait(bound) = options.in_flight {
            database.lock_wait = bound;
        }
        serve_on::<S>(database, options).await
    }
}

/// `idemkey gateway`.
struct Gateway(GatewayArgs);

impl OnDatabase for Gateway {
    type Output = ();

    async fn run<S: Backend>(self) -> anyhow::Result<()> {
        let Self(args) = self;
        check_before_start::<S>(
            &args.database_url,
            &KeySecretSource::from(&args.secret),
            args.key_secret_in_database,
        )?;
        let options = GatewayOptions::try_from(&args)?;
        let db = S::connect(&args.database()).await?;
        idemkey_server::gateway::gateway(db, options).await
    }
}

/// `idemkey migrate`.
struct Migrate(DatabaseOptions);

impl OnDatabase for Migrate {
    type Output = ();

    async fn run<S: Backend>(self) -> anyhow::Result<()> {
        S::connect(&self.0).await?.migrate_all().await
    }
}

/// `idemkey relay`.
struct Relay(RelayArgs);

impl OnDatabase for Relay {
    type Output = ();

    async fn run<S: Backend>(self) -> anyhow::Result<()> {
        let Self(args) = self;
        let db = open_existing::<S>(&(&args.db).into()).await?;
        let options = OutboxOptions::try_from(&args.outbox)?;
        idemkey_server::outbox::relay(db, options, args.listen).await
    }
}

/// `idemkey outbox …`.
struct Outbox(DatabaseOptions, OutboxAction);

impl OnDatabase for Outbox {
    type Output = ();

    async fn run<S: Backend>(self) -> anyhow::Result<()> {
        let Self(database, action) = self;
        let db = open_existing::<S>(&database).await?;
        idemkey_server::outbox::run(db, action, &mut std::io::stdout().lock()).await
    }
}

/// `idemkey keys …`: operator commands create nothing (no file, no tables, no secret).
struct Keys(DatabaseOptions, KeySecretSource, KeysAction);

impl OnDatabase for Keys {
    type Output = ();

    async fn run<S: Backend>(self) -> anyhow::Result<()> {
        let Self(database, secret, action) = self;
        let db = open_existing::<S>(&database).await?;
        let mut out = std::io::stdout().lock();
        keys::run(db, &database.url, &secret, action, &mut out).await
    }
}
