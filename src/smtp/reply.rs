//! SMTP replies: a code, an enhanced status code (RFC 3463) and text,
//! written the way RFC 5321 section 4.2 wants them (`250-` continuation
//! lines, `250 ` last), each line at most 512 octets (section 4.5.3.1.5).
//!
//! smtp-proto parses replies but writes them on one line and always with
//! an enhanced code, so relaying an upstream's multi-line reply needs this
//! writer.

use std::borrow::Cow;
use std::fmt::Write as _;

/// The longest text on one reply line: 512 octets less the code, the
/// separator, the enhanced code and CRLF.
const MAX_LINE_TEXT: usize = 512 - 4 - 12 - 2;

/// One reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub code: u16,
    /// `[class, subject, detail]`; `[0, 0, 0]` for none.
    pub esc: [u16; 3],
    /// Lines separated by `\n`.
    pub text: Cow<'static, str>,
}

impl Reply {
    pub const fn new(code: u16, esc: [u16; 3], text: &'static str) -> Reply {
        Reply {
            code,
            esc,
            text: Cow::Borrowed(text),
        }
    }

    pub fn owned(code: u16, esc: [u16; 3], text: String) -> Reply {
        Reply {
            code,
            esc,
            text: Cow::Owned(text),
        }
    }

    /// A reply smtp-proto parsed (an upstream's).
    pub fn from_parsed(r: smtp_proto::Response<String>) -> Reply {
        Reply {
            code: r.code,
            esc: r.esc.map(u16::from),
            text: Cow::Owned(r.message),
        }
    }

    pub fn is_positive(&self) -> bool {
        (200..400).contains(&self.code)
    }

    pub fn is_transient(&self) -> bool {
        (400..500).contains(&self.code)
    }

    /// Append the reply to `out`. With `enhanced` (the client was offered
    /// ENHANCEDSTATUSCODES), a reply without an enhanced code gets
    /// `class.0.0`; the 220 greeting and the EHLO reply never carry one.
    pub fn write(&self, out: &mut Vec<u8>, enhanced: bool) {
        let esc = match self.esc {
            [0, 0, 0] if enhanced && (self.code / 100 == 2 || self.code / 100 >= 4) => {
                [self.code / 100, 0, 0]
            }
            esc if enhanced => esc,
            _ => [0, 0, 0],
        };
        let mut text = String::new();
        let lines: Vec<&str> = self.text.split('\n').collect();
        for (i, line) in lines.iter().enumerate() {
            let sep = if i + 1 == lines.len() { ' ' } else { '-' };
            text.clear();
            let _ = write!(text, "{}{sep}", self.code);
            if esc != [0, 0, 0] {
                let _ = write!(text, "{}.{}.{} ", esc[0], esc[1], esc[2]);
            }
            // An upstream's text reaches the client: no control character
            // of it may end a line early.
            let line = cut(line.trim_end_matches('\r'), MAX_LINE_TEXT);
            text.extend(line.chars().map(|c| if c.is_control() { ' ' } else { c }));
            out.extend_from_slice(text.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
    }
}

/// `line` cut to at most `max` bytes, on a character boundary.
fn cut(line: &str, max: usize) -> &str {
    if line.len() <= max {
        return line;
    }
    let mut end = max;
    while !line.is_char_boundary(end) {
        end -= 1;
    }
    &line[..end]
}

// Replies sluice gives itself, with their RFC basis.

/// RFC 3207.
pub const TLS_READY: Reply = Reply::new(220, [2, 0, 0], "Ready to start TLS");
pub const TLS_UNAVAILABLE: Reply = Reply::new(454, [4, 7, 0], "TLS not available");
pub const TLS_REQUIRED: Reply = Reply::new(530, [5, 7, 0], "Must issue a STARTTLS command first");
/// RFC 4954.
pub const AUTH_OK: Reply = Reply::new(235, [2, 7, 0], "Authentication succeeded");
pub const AUTH_FAILED: Reply = Reply::new(535, [5, 7, 8], "Authentication credentials invalid");
pub const AUTH_REQUIRED: Reply = Reply::new(530, [5, 7, 0], "Authentication required");
pub const AUTH_NEEDS_TLS: Reply = Reply::new(
    538,
    [5, 7, 11],
    "Encryption required for requested authentication mechanism",
);
pub const AUTH_CANCELLED: Reply = Reply::new(501, [5, 7, 0], "Authentication cancelled");
pub const AUTH_BAD_BASE64: Reply = Reply::new(501, [5, 5, 2], "Cannot decode the response");
pub const AUTH_MECHANISM: Reply = Reply::new(
    504,
    [5, 5, 4],
    "Unrecognized authentication type: use PLAIN or LOGIN",
);
pub const AUTH_LINE_TOO_LONG: Reply =
    Reply::new(500, [5, 5, 6], "Authentication Exchange line is too long");
pub const ALREADY_AUTHENTICATED: Reply = Reply::new(503, [5, 5, 1], "Already authenticated");
/// RFC 5321 4.1.1.
pub const OK: Reply = Reply::new(250, [2, 0, 0], "Ok");
pub const SENDER_OK: Reply = Reply::new(250, [2, 1, 0], "Sender ok");
pub const RECIPIENT_OK: Reply = Reply::new(250, [2, 1, 5], "Recipient ok");
pub const START_DATA: Reply = Reply::new(354, [0, 0, 0], "End data with <CR><LF>.<CR><LF>");
pub const BYE: Reply = Reply::new(221, [2, 0, 0], "Bye");
/// RFC 5321 3.5.3 and 7.3: a site that disables VRFY answers 252.
pub const VRFY_REFUSED: Reply = Reply::new(
    252,
    [2, 5, 0],
    "Cannot VRFY user, but will accept message and attempt delivery",
);
pub const EXPN_REFUSED: Reply = Reply::new(502, [5, 5, 1], "EXPN is not supported");
pub const HELP: Reply = Reply::new(
    214,
    [2, 0, 0],
    "Commands: EHLO HELO MAIL RCPT DATA RSET NOOP QUIT VRFY STARTTLS AUTH",
);
pub const NOT_IMPLEMENTED: Reply = Reply::new(502, [5, 5, 1], "Command not implemented");
pub const UNKNOWN_COMMAND: Reply = Reply::new(500, [5, 5, 1], "Command unrecognized");
pub const LINE_TOO_LONG: Reply = Reply::new(500, [5, 5, 2], "Line too long");
pub const SYNTAX: Reply = Reply::new(501, [5, 5, 4], "Syntax error in parameters or arguments");
pub const BAD_SENDER: Reply = Reply::new(501, [5, 1, 7], "Bad sender address syntax");
pub const BAD_RECIPIENT: Reply = Reply::new(501, [5, 1, 3], "Bad recipient address syntax");
pub const UNSUPPORTED_PARAMETER: Reply = Reply::new(
    555,
    [5, 5, 4],
    "MAIL FROM/RCPT TO parameter not recognized or not implemented",
);
pub const NEED_HELO: Reply = Reply::new(503, [5, 5, 1], "Send EHLO or HELO first");
pub const NESTED_MAIL: Reply = Reply::new(503, [5, 5, 1], "Sender already specified");
pub const NEED_MAIL: Reply = Reply::new(503, [5, 5, 1], "Need MAIL command first");
pub const NEED_RCPT: Reply = Reply::new(554, [5, 5, 1], "No valid recipients");
pub const IN_TRANSACTION: Reply =
    Reply::new(503, [5, 5, 1], "Not allowed during a mail transaction");
pub const TOO_MANY_RECIPIENTS: Reply = Reply::new(452, [4, 5, 3], "Too many recipients");
/// RFC 1870.
pub const TOO_BIG: Reply = Reply::new(
    552,
    [5, 3, 4],
    "Message size exceeds fixed maximum message size",
);
pub const NO_STORAGE: Reply = Reply::new(
    452,
    [4, 3, 1],
    "Insufficient system storage: too many messages are held; try again later",
);
pub const TOO_MANY_ERRORS: Reply =
    Reply::new(421, [4, 7, 0], "Too many errors, closing connection");
pub const TIMEOUT: Reply = Reply::new(421, [4, 4, 2], "Timeout exceeded, closing connection");
pub const SHUTTING_DOWN: Reply =
    Reply::new(421, [4, 3, 2], "Service shutting down, closing connection");
pub const OVERLOADED: Reply = Reply::new(
    421,
    [4, 3, 2],
    "Too busy to take more mail now, closing connection; try again later",
);
pub const REFUSED_SESSION: Reply = Reply::new(
    503,
    [5, 5, 1],
    "Bad sequence of commands: this session was refused",
);
pub const RELAY_DENIED: Reply = Reply::new(554, [5, 7, 1], "Relay access denied");
/// RFC 6531 3.4: a non-ASCII address in a transaction not declared
/// SMTPUTF8.
pub const UTF8_UNDECLARED: Reply = Reply::new(
    553,
    [5, 6, 7],
    "Non-ASCII addresses need the SMTPUTF8 parameter",
);
pub const UTF8_UNSUPPORTED: Reply =
    Reply::new(553, [5, 6, 7], "The upstream does not support SMTPUTF8");
pub const EIGHTBIT_UNSUPPORTED: Reply =
    Reply::new(554, [5, 6, 3], "The upstream does not support 8BITMIME");
pub const UPSTREAM_UNREACHABLE: Reply = Reply::new(
    451,
    [4, 4, 1],
    "The upstream relay cannot be reached; try again later",
);
pub const UPSTREAM_LOST: Reply = Reply::new(
    451,
    [4, 4, 2],
    "The connection to the upstream relay was lost; try again later",
);
pub const EXPIRED: Reply = Reply::new(
    451,
    [4, 7, 0],
    "Still queued after max_wait (the upstream is paused or capped); try again later",
);
pub const PAUSED_TOO_LONG: Reply = Reply::new(
    451,
    [4, 7, 0],
    "The upstream is paused past the time the answer can wait; try again later",
);

#[cfg(test)]
mod tests {
    use super::*;

    fn written(r: &Reply, enhanced: bool) -> String {
        let mut out = Vec::new();
        r.write(&mut out, enhanced);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn multi_line_replies_continue_with_a_dash() {
        let r = Reply::owned(250, [2, 0, 0], "one\ntwo\nthree".to_owned());
        assert_eq!(
            written(&r, true),
            "250-2.0.0 one\r\n250-2.0.0 two\r\n250 2.0.0 three\r\n"
        );
    }

    #[test]
    fn an_enhanced_code_is_made_up_only_when_offered() {
        let r = Reply::owned(451, [0, 0, 0], "later".to_owned());
        assert_eq!(written(&r, true), "451 4.0.0 later\r\n");
        assert_eq!(written(&r, false), "451 later\r\n");
        assert_eq!(
            written(&START_DATA, true),
            "354 End data with <CR><LF>.<CR><LF>\r\n"
        );
    }

    #[test]
    fn long_lines_are_cut_to_the_rfc_limit_on_a_character_boundary() {
        let r = Reply::owned(250, [2, 0, 0], "é".repeat(400));
        let out = written(&r, true);
        assert!(out.len() <= 512, "{}", out.len());
        assert!(out.ends_with("\r\n"));
    }
}
