//! The checks.

use super::{CheckError, CheckOptions, Report};

pub(super) async fn run(options: CheckOptions) -> Result<Report, CheckError> {
    let _ = options;
    Err(CheckError::BadArguments("not yet".to_owned()))
}
