//! How a command's error ends the process: exit 2 for bad input (a flag or file refused,
//! nothing bound, touched or started), 1 for a failure at run time.

/// The error a command ends with (`main` prints [`CommandError::line`] and exits with
/// [`CommandError::exit_code`]).
pub trait CommandError: std::error::Error {
    /// Bad flags or files: nothing was bound, touched or started.
    fn is_bad_input(&self) -> bool;

    /// 2 for bad input, 1 otherwise.
    fn exit_code(&self) -> u8 {
        if self.is_bad_input() {
            2
        } else {
            1
        }
    }

    /// The error on one line, as the operator reads it.
    fn line(&self) -> String {
        self.to_string()
    }
}

/// A command's error and every cause, `a: b: c` (for errors whose message does not repeat
/// their source).
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut line = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        line.push_str(": ");
        line.push_str(&s.to_string());
        source = s.source();
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] std::io::Error);

    impl CommandError for Outer {
        fn is_bad_input(&self) -> bool {
            self.0.kind() == std::io::ErrorKind::InvalidInput
        }
    }

    #[test]
    fn bad_input_is_2_a_failure_1_and_the_line_names_every_cause() {
        let bad = Outer(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "inner",
        ));
        let failed = Outer(std::io::Error::other("inner"));
        assert_eq!((bad.exit_code(), failed.exit_code()), (2, 1));
        assert_eq!(chain(&bad), "outer: inner");
    }
}
