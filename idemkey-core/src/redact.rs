//! URLs made safe to print: what a log line, an error message or `Debug` shows of a URL
//! that may carry credentials.

/// The query parameters whose values are credentials, compared without regard to case.
pub const CREDENTIAL_PARAMETERS: [&str; 10] = [
    "password",
    "passwd",
    "pass",
    "pwd",
    "token",
    "access_token",
    "auth",
    "key",
    "api_key",
    "secret",
];

/// What replaces a hidden credential.
const HIDDEN: &str = "***";

/// `url` with its credentials replaced by `***`: the password of its user information
/// (`postgres://user:***@host/db`) and the value of every query parameter named in
/// [`CREDENTIAL_PARAMETERS`] (`…?sslmode=require&password=***`). Anything else is kept, so
/// that the message still says where it went; a text that is not a URL comes back with only
/// its query parameters hidden.
///
/// ```
/// use idemkey_core::redact_url;
///
/// assert_eq!(
///     redact_url("postgres://app:hunter2@db:5432/pay?sslmode=require&password=hunter2"),
///     "postgres://app:***@db:5432/pay?sslmode=require&password=***"
/// );
/// assert_eq!(redact_url("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
/// ```
pub fn redact_url(url: &str) -> String {
    // The user information first: a password that (wrongly) holds a `?` or `#` is hidden
    // whole before the query is looked at.
    let (mut shown, rest) = split_user_info(url);
    let (rest, fragment) = match rest.split_once('#') {
        Some((rest, fragment)) => (rest, Some(fragment)),
        None => (rest, None),
    };
    match rest.split_once('?') {
        Some((path, query)) => {
            shown.push_str(path);
            shown.push('?');
            let pairs: Vec<String> = query.split('&').map(redact_parameter).collect();
            shown.push_str(&pairs.join("&"));
        }
        None => shown.push_str(rest),
    }
    if let Some(fragment) = fragment {
        shown.push('#');
        shown.push_str(fragment);
    }
    shown
}

/// `scheme://user:password@rest` → (`scheme://user:***@`, `rest`); without a password,
/// (``, the whole URL).
fn split_user_info(url: &str) -> (String, &str) {
    if let Some((scheme, rest)) = url.split_once("://") {
        let authority = &rest[..rest.find('/').unwrap_or(rest.len())];
        if let Some(at) = authority.rfind('@')
            && let Some((user, _)) = authority[..at].split_once(':')
        {
            return (format!("{scheme}://{user}:{HIDDEN}@"), &rest[at + 1..]);
        }
    }
    (String::new(), url)
}

/// `name=value` → `name=***` when `name` is a credential's.
fn redact_parameter(pair: &str) -> String {
    match pair.split_once('=') {
        Some((name, _)) if is_credential(name) => format!("{name}={HIDDEN}"),
        _ => pair.to_owned(),
    }
}

fn is_credential(name: &str) -> bool {
    CREDENTIAL_PARAMETERS
        .iter()
        .any(|c| c.eq_ignore_ascii_case(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hides_the_password_of_the_user_information() {
        assert_eq!(
            redact_url("postgres://u:pw@h:5432/db"),
            "postgres://u:***@h:5432/db"
        );
        assert_eq!(redact_url("postgres://u@h/db"), "postgres://u@h/db");
        assert_eq!(redact_url("sqlite:none.db"), "sqlite:none.db");
        // An `@`, `?` or `#` in the password: the last `@` before the path ends the user
        // information.
        assert_eq!(
            redact_url("postgres://u:p@s?s#@h/db"),
            "postgres://u:***@h/db"
        );
    }

    #[test]
    fn hides_credential_query_parameters() {
        assert_eq!(
            redact_url("postgres://h/db?user=app&password=pw&sslmode=require"),
            "postgres://h/db?user=app&password=***&sslmode=require"
        );
        assert_eq!(
            redact_url("https://hooks.example/in?Token=t0k&access_token=a&x=1#frag"),
            "https://hooks.example/in?Token=***&access_token=***&x=1#frag"
        );
        assert_eq!(
            redact_url("sqlite:a.db?mode=rwc&key=k"),
            "sqlite:a.db?mode=rwc&key=***"
        );
        // A parameter without a value, and names that only contain a credential's name.
        assert_eq!(
            redact_url("http://h/?token&keyboard=1&monkey=2"),
            "http://h/?token&keyboard=1&monkey=2"
        );
    }
}
