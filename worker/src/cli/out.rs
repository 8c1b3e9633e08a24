//! Standard output of the commands. A reader that stops reading (`status --json | head -0`)
//! closes the pipe; `println!` would then panic, so the commands write through [`write`], which
//! returns [`StdoutClosed`] instead, and `main` ends quietly on it.

use std::fmt;
use std::io::{ErrorKind, Write};

/// Standard output was closed by its reader: nothing more is wanted, nothing went wrong.
#[derive(Debug, thiserror::Error)]
#[error("standard output closed")]
pub struct StdoutClosed;

/// Writes `args` to standard output.
pub fn write(args: fmt::Arguments<'_>) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    match stdout.write_fmt(args).and_then(|()| stdout.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::BrokenPipe => Err(StdoutClosed.into()),
        Err(e) => Err(anyhow::Error::new(e).context("writing to standard output")),
    }
}

/// `print!` returning [`out::write`](write)'s result.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::cli::out::write(format_args!($($arg)*))
    };
}

/// `println!` returning [`out::write`](write)'s result.
macro_rules! outln {
    () => {
        $crate::cli::out::write(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::cli::out::write(format_args!("{}\n", format_args!($($arg)*)))
    };
}

pub(crate) use {out, outln};
