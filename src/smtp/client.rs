//! One session with an SMTP upstream: connect, greeting, EHLO, STARTTLS,
//! AUTH, then messages, one transaction at a time, PIPELINING when the
//! upstream offers it.
//!
//! Our own thin client on smtp-proto's reply parser rather than lettre or
//! mail-send: the pacer needs to know exactly when a message goes out and
//! what the upstream answered, code, enhanced code and text (lettre drops
//! the enhanced code and turns refusals into errors without their text),
//! with per-step deadlines (lettre has none past the connect) and a read
//! buffer that never drops a pipelined reply (mail-send reads into a fresh
//! buffer per reply).

use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use rustls::pki_types::ServerName;
use smtp_proto::{
    AUTH_LOGIN, AUTH_PLAIN, EXT_8BIT_MIME, EXT_PIPELINING, EXT_SIZE, EXT_SMTP_UTF8, EXT_START_TLS,
    EhloResponse,
};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use super::io::{InBuf, Stream};
use super::reply::Reply;
use crate::config::{SmtpTls, SmtpUpstream};

/// The longest reply taken from an upstream (an EHLO reply with many
/// extensions is a few hundred bytes).
const MAX_REPLY: usize = 64 * 1024;

/// How long a closing session waits for the reply to QUIT.
const QUIT_WAIT: Duration = Duration::from_secs(2);

/// Why a message was not relayed.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// No session: connect, TLS, or a dead connection before a reply.
    #[error("the upstream cannot be reached: {0}")]
    Unreachable(String),
    /// The upstream refused while the session was set up (greeting, EHLO,
    /// STARTTLS, AUTH).
    #[error("the upstream refused the session: {} {}", .0.code, .0.text)]
    Setup(Reply),
    /// The upstream does not offer what sluice needs of it (STARTTLS, an
    /// AUTH mechanism sluice speaks).
    #[error("{0}")]
    Unsupported(String),
    /// The upstream refused the message (MAIL, RCPT, DATA or its end).
    #[error("the upstream refused the message: {} {}", .0.code, .0.text)]
    Refused(Reply),
    /// The message needs an extension the upstream lacks (8BITMIME,
    /// SMTPUTF8), or is larger than the SIZE it offers; the reply to give
    /// says which. Never sent.
    #[error("{}", .0.text)]
    Incapable(Reply),
    /// The connection failed or timed out mid-transaction; `after_dot`
    /// when the message may have been taken (the end of data was sent).
    #[error("the upstream connection was lost ({why}){}", if *.after_dot { " after the end of data: the message may have been taken" } else { "" })]
    Lost { after_dot: bool, why: String },
    /// No session became free before the deadline.
    #[error("no upstream connection became free in time")]
    Busy,
}

impl RelayError {
    /// Whether trying again on a fresh session is safe and may help: the
    /// session was stale (closed, or the upstream said 421), and the end
    /// of data had not started going (`committed`: the message may have
    /// been taken, even with a 421 to it).
    pub fn stale_session(&self, committed: bool) -> bool {
        !committed
            && match self {
                RelayError::Lost { .. } => true,
                RelayError::Refused(r) | RelayError::Setup(r) => r.code == 421,
                _ => false,
            }
    }
}

/// The message to relay.
pub struct Envelope {
    /// MAIL FROM address; empty for the null sender.
    pub from: String,
    pub eightbit: bool,
    pub smtputf8: bool,
    pub rcpts: Vec<String>,
    /// Set once the end of data starts going upstream: from then on the
    /// upstream may take the message whatever happens to the relay.
    pub committed: std::sync::atomic::AtomicBool,
    /// How long the reply to the end of data is waited for, if past the
    /// relay's deadline: giving up on it would have the client send again
    /// a message the upstream may have taken, so it is waited for as long
    /// as the client waits (RFC 5321 4.5.3.2.6 gives 10 minutes from the
    /// client's end of data; Postfix's `smtp_data_done_timeout`).
    pub reply_by: Instant,
}

/// What an upstream said it supports.
#[derive(Debug, Clone, Copy, Default)]
struct Caps {
    pipelining: bool,
    eightbit: bool,
    smtputf8: bool,
    size: bool,
    /// `SIZE n`: 0 for no stated limit.
    max_size: usize,
    starttls: bool,
    auth: u64,
}

impl Caps {
    fn from_ehlo(e: &EhloResponse<String>) -> Caps {
        Caps {
            pipelining: e.has_capability(EXT_PIPELINING),
            eightbit: e.has_capability(EXT_8BIT_MIME),
            smtputf8: e.has_capability(EXT_SMTP_UTF8),
            size: e.has_capability(EXT_SIZE),
            max_size: e.size,
            starttls: e.has_capability(EXT_START_TLS),
            auth: e.auth(),
        }
    }
}

/// How to reach one upstream: its config and TLS settings.
pub struct Target {
    pub cfg: SmtpUpstream,
    pub tls: Arc<rustls::ClientConfig>,
    pub server_name: Option<ServerName<'static>>,
}

/// An open session, between transactions.
pub struct Session {
    stream: Stream,
    inbuf: InBuf,
    caps: Caps,
    /// Messages sent on it.
    pub messages: u32,
    /// Since when it waits unused.
    pub idle_since: Instant,
    /// The upstream said 421 or the connection broke: not to be reused.
    broken: bool,
}

/// `Err(Lost)` for an I/O failure or a passed deadline.
async fn within<T>(
    deadline: Instant,
    after_dot: bool,
    fut: impl Future<Output = std::io::Result<T>>,
) -> Result<T, RelayError> {
    match tokio::time::timeout_at(deadline.into(), fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(RelayError::Lost {
            after_dot,
            why: e.to_string(),
        }),
        Err(_) => Err(RelayError::Lost {
            after_dot,
            why: "timed out".to_owned(),
        }),
    }
}

/// The length of the first complete reply in `buf`: lines up to one whose
/// fourth byte is not `-`.
fn complete_reply(buf: &[u8]) -> Option<usize> {
    let mut start = 0;
    while let Some(lf) = buf[start..].iter().position(|&b| b == b'\n') {
        let line = &buf[start..start + lf + 1];
        start += lf + 1;
        if line.get(3) != Some(&b'-') {
            return Some(start);
        }
    }
    None
}

/// A reply path for a command: `<>`, or the address with its local part
/// quoted when it is not a dot-atom (smtp-proto hands addresses over
/// unquoted).
pub fn path(address: &str) -> String {
    if address.is_empty() {
        return "<>".to_owned();
    }
    let (local, domain) = match address.rsplit_once('@') {
        Some((l, d)) => (l, Some(d)),
        None => (address, None),
    };
    let atext =
        |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-/=?^_`{|}~".contains(c) || !c.is_ascii();
    let dot_atom = !local.is_empty()
        && !local.starts_with('.')
        && !local.ends_with('.')
        && !local.contains("..")
        && local.chars().all(|c| c == '.' || atext(c));
    let local = if dot_atom {
        local.to_owned()
    } else {
        let escaped: String = local
            .chars()
            .flat_map(|c| match c {
                '"' | '\\' => vec!['\\', c],
                c => vec![c],
            })
            .collect();
        format!("\"{escaped}\"")
    };
    match domain {
        Some(d) => format!("<{local}@{d}>"),
        None => format!("<{local}>"),
    }
}

/// Commands written at once before their replies are read (see
/// [`Session::send`]).
const PIPELINE_GROUP: usize = 100;

/// A message's text as it goes on the wire, piece by piece (a large
/// message is not copied whole): a dot doubled at the start of every line
/// (a line starting after a bare CR or LF too, so a message cannot smuggle
/// an end of data past a relay that reads bare line ends), and a last line
/// end when the text lacks one. The end of data goes after it.
#[derive(Debug)]
struct Stuffer<'a> {
    body: &'a [u8],
    /// How much of `body` has gone into pieces.
    at: usize,
    line_start: bool,
}

impl<'a> Stuffer<'a> {
    fn new(body: &'a [u8]) -> Stuffer<'a> {
        Stuffer {
            body,
            at: 0,
            line_start: true,
        }
    }

    /// The next piece: up to `max` bytes of the text, stuffed, in `out`
    /// (cleared first); `false` once the whole text has gone.
    fn next_piece(&mut self, max: usize, out: &mut Vec<u8>) -> bool {
        if self.at >= self.body.len() {
            return false;
        }
        out.clear();
        let end = self.at.saturating_add(max.max(1)).min(self.body.len());
        for &b in &self.body[self.at..end] {
            if self.line_start && b == b'.' {
                out.push(b'.');
            }
            out.push(b);
            self.line_start = b == b'\n' || b == b'\r';
        }
        self.at = end;
        if end == self.body.len() && !self.body.ends_with(b"\r\n") {
            out.extend_from_slice(b"\r\n");
        }
        true
    }
}

/// How much of a message's text is stuffed and written at a time.
const TEXT_PIECE: usize = 64 * 1024;

/// What ends a message's text (RFC 5321 4.1.1.4), after its last CRLF.
const END_OF_DATA: &[u8] = b".\r\n";

impl Session {
    /// Open a session: connect, greeting, EHLO, STARTTLS (then EHLO
    /// again), AUTH; all within the upstream's `connect_timeout`, and by
    /// `by` (the relay's deadline, which the setup is part of).
    pub async fn open(target: &Target, by: Instant) -> Result<Session, RelayError> {
        let cfg = &target.cfg;
        let deadline = by.min(Instant::now() + cfg.connect_timeout);
        let unreachable = |e: std::io::Error| RelayError::Unreachable(e.to_string());
        let tcp = match tokio::time::timeout_at(
            deadline.into(),
            TcpStream::connect((cfg.host.as_str(), cfg.port)),
        )
        .await
        {
            Ok(Ok(tcp)) => tcp,
            Ok(Err(e)) => return Err(unreachable(e)),
            Err(_) => return Err(RelayError::Unreachable("connect timed out".to_owned())),
        };
        // The end of data is a small write after a large one: Nagle would
        // hold it for an ACK.
        let _ = tcp.set_nodelay(true);
        let mut session = Session {
            stream: Stream::Plain(tcp),
            inbuf: InBuf::default(),
            caps: Caps::default(),
            messages: 0,
            idle_since: Instant::now(),
            broken: false,
        };
        let setup = |e: RelayError| match e {
            RelayError::Lost { why, .. } => RelayError::Unreachable(why),
            other => other,
        };
        if cfg.tls == SmtpTls::Implicit {
            session.start_tls(target, deadline).await.map_err(setup)?;
        }
        let greeting = session.reply(deadline, false).await.map_err(setup)?;
        if greeting.code != 220 {
            return Err(RelayError::Setup(greeting));
        }
        session
            .ehlo(&cfg.helo_name, deadline)
            .await
            .map_err(setup)?;
        if cfg.tls == SmtpTls::StartTls {
            if !session.caps.starttls {
                return Err(RelayError::Unsupported(
                    "the upstream does not offer STARTTLS (set tls = \"none\" to relay in clear text)"
                        .to_owned(),
                ));
            }
            let r = session
                .command(b"STARTTLS\r\n", deadline)
                .await
                .map_err(setup)?;
            if r.code != 220 {
                return Err(RelayError::Setup(r));
            }
            // RFC 3207: nothing sent before the handshake counts.
            session.inbuf.discard();
            session.start_tls(target, deadline).await.map_err(setup)?;
            session
                .ehlo(&cfg.helo_name, deadline)
                .await
                .map_err(setup)?;
        }
        if let Some((user, password)) = &cfg.auth {
            session
                .auth(user, password.expose(), deadline)
                .await
                .map_err(setup)?;
        }
        Ok(session)
    }

    async fn start_tls(&mut self, target: &Target, deadline: Instant) -> Result<(), RelayError> {
        let Some(name) = target.server_name.clone() else {
            return Err(RelayError::Unreachable(format!(
                "'{}' cannot be verified by TLS",
                target.cfg.host
            )));
        };
        let tls = target.tls.clone();
        within(deadline, false, self.stream.connect_tls(tls, name)).await
    }

    async fn ehlo(&mut self, name: &str, deadline: Instant) -> Result<(), RelayError> {
        self.write_commands(format!("EHLO {name}\r\n").as_bytes(), deadline)
            .await?;
        let raw = self.raw_reply(deadline, false).await?;
        match EhloResponse::parse(&mut raw.iter()) {
            Ok(e) => {
                self.caps = Caps::from_ehlo(&e);
                Ok(())
            }
            Err(_) => {
                let refused = parse_reply(&raw, false)?;
                // RFC 5321 4.1.4: a server that does not take EHLO (500,
                // 501, 502 or 550) is greeted with HELO, and offers no
                // extension.
                if !matches!(refused.code, 500 | 501 | 502 | 550) {
                    return Err(RelayError::Setup(refused));
                }
                let helo = self
                    .command(format!("HELO {name}\r\n").as_bytes(), deadline)
                    .await?;
                if helo.code != 250 {
                    return Err(RelayError::Setup(helo));
                }
                self.caps = Caps::default();
                Ok(())
            }
        }
    }

    /// AUTH PLAIN when offered, else LOGIN.
    async fn auth(
        &mut self,
        user: &str,
        password: &str,
        deadline: Instant,
    ) -> Result<(), RelayError> {
        let done = if self.caps.auth & AUTH_PLAIN != 0 {
            let token = BASE64.encode(format!("\0{user}\0{password}"));
            self.command(format!("AUTH PLAIN {token}\r\n").as_bytes(), deadline)
                .await?
        } else if self.caps.auth & AUTH_LOGIN != 0 {
            let r = self.command(b"AUTH LOGIN\r\n", deadline).await?;
            if r.code != 334 {
                return Err(RelayError::Setup(r));
            }
            let r = self
                .command(format!("{}\r\n", BASE64.encode(user)).as_bytes(), deadline)
                .await?;
            if r.code != 334 {
                return Err(RelayError::Setup(r));
            }
            self.command(
                format!("{}\r\n", BASE64.encode(password)).as_bytes(),
                deadline,
            )
            .await?
        } else {
            return Err(RelayError::Unsupported(
                "the upstream offers neither AUTH PLAIN nor AUTH LOGIN".to_owned(),
            ));
        };
        if done.code == 235 {
            Ok(())
        } else {
            Err(RelayError::Setup(done))
        }
    }

    async fn command(&mut self, line: &[u8], deadline: Instant) -> Result<Reply, RelayError> {
        self.write_commands(line, deadline).await?;
        self.reply(deadline, false).await
    }

    /// Write commands whose replies are read next, flushed: over TLS,
    /// a write ends once rustls holds the bytes, and what the socket had
    /// no room for would wait in it while sluice waits for the replies.
    async fn write_commands(
        &mut self,
        commands: &[u8],
        deadline: Instant,
    ) -> Result<(), RelayError> {
        within(deadline, false, async {
            self.stream.write_all(commands).await?;
            self.stream.flush().await
        })
        .await
    }

    /// The next complete reply's bytes.
    async fn raw_reply(
        &mut self,
        deadline: Instant,
        after_dot: bool,
    ) -> Result<Vec<u8>, RelayError> {
        loop {
            if let Some(n) = complete_reply(self.inbuf.unread()) {
                let raw = self.inbuf.unread()[..n].to_vec();
                self.inbuf.consume(n);
                return Ok(raw);
            }
            if self.inbuf.len() > MAX_REPLY {
                self.broken = true;
                return Err(RelayError::Lost {
                    after_dot,
                    why: "the upstream's reply is too long".to_owned(),
                });
            }
            let n = within(deadline, after_dot, self.inbuf.fill(&mut self.stream)).await;
            match n {
                Ok(0) => {
                    self.broken = true;
                    return Err(RelayError::Lost {
                        after_dot,
                        why: "the upstream closed the connection".to_owned(),
                    });
                }
                Ok(_) => {}
                Err(e) => {
                    self.broken = true;
                    return Err(e);
                }
            }
        }
    }

    async fn reply(&mut self, deadline: Instant, after_dot: bool) -> Result<Reply, RelayError> {
        let raw = self.raw_reply(deadline, after_dot).await?;
        let reply = parse_reply(&raw, after_dot).inspect_err(|_| self.broken = true)?;
        if reply.code == 421 {
            // The upstream closes the session (RFC 5321 3.8).
            self.broken = true;
        }
        Ok(reply)
    }

    /// Relay one message; the upstream's reply to its end of data, or why
    /// there is none. A session that lost its place in the exchange (a
    /// write or read that failed or timed out) is never used again: the
    /// upstream may still be reading the last message's data.
    pub async fn send(
        &mut self,
        env: &Envelope,
        body: &[u8],
        deadline: Instant,
    ) -> Result<Reply, RelayError> {
        let result = self.transaction(env, body, deadline).await;
        if let Err(RelayError::Lost { .. }) = result {
            self.broken = true;
        }
        result
    }

    async fn transaction(
        &mut self,
        env: &Envelope,
        body: &[u8],
        deadline: Instant,
    ) -> Result<Reply, RelayError> {
        // A message declared SMTPUTF8 or 8BITMIME that does not need it
        // (its envelope and header, or its body, all ASCII: some clients
        // declare whatever is offered) goes to an upstream without the
        // extension as it is, as Postfix relays it.
        let utf8 = env.smtputf8 && self.caps.smtputf8;
        if env.smtputf8
            && !utf8
            && !(env.from.is_ascii()
                && env.rcpts.iter().all(|r| r.is_ascii())
                && header_section(body).is_ascii())
        {
            return Err(RelayError::Incapable(super::reply::UTF8_UNSUPPORTED));
        }
        let eightbit = env.eightbit && self.caps.eightbit;
        if env.eightbit && !eightbit && !body.is_ascii() {
            return Err(RelayError::Incapable(super::reply::EIGHTBIT_UNSUPPORTED));
        }
        if self.caps.size && self.caps.max_size > 0 && body.len() > self.caps.max_size {
            return Err(RelayError::Incapable(Reply::owned(
                552,
                [5, 3, 4],
                format!(
                    "Message size exceeds the upstream's maximum of {} bytes",
                    self.caps.max_size
                ),
            )));
        }
        self.messages += 1;
        let mut mail = format!("MAIL FROM:{}", path(&env.from));
        if eightbit {
            mail.push_str(" BODY=8BITMIME");
        }
        if utf8 {
            mail.push_str(" SMTPUTF8");
        }
        if self.caps.size {
            mail.push_str(&format!(" SIZE={}", body.len()));
        }
        mail.push_str("\r\n");
        let rcpts: Vec<String> = env
            .rcpts
            .iter()
            .map(|r| format!("RCPT TO:{}\r\n", path(r)))
            .collect();
        let replies = if self.caps.pipelining {
            let commands: Vec<&[u8]> = std::iter::once(mail.as_bytes())
                .chain(rcpts.iter().map(String::as_bytes))
                .chain(std::iter::once(&b"DATA\r\n"[..]))
                .collect();
            let mut replies = Vec::with_capacity(rcpts.len() + 2);
            let mut sent = 0;
            while replies.len() < commands.len() {
                // In groups of at most PIPELINE_GROUP, each one's replies
                // read before the next is written: an upstream that
                // answers as it reads (Postfix) stops reading once its
                // replies fill the socket, and a whole envelope of
                // thousands of recipients written before reading any
                // reply stalled until the relay's deadline (RFC 2920 3.1).
                if replies.len() == sent {
                    let end = (sent + PIPELINE_GROUP).min(commands.len());
                    let group = commands[sent..end].concat();
                    self.write_commands(&group, deadline).await?;
                    sent = end;
                }
                let reply = match self.reply(deadline, false).await {
                    Ok(reply) => reply,
                    // An upstream that refused part of the group and then
                    // closed (or stopped answering): its refusal stands.
                    // Taken for a lost session, it became a 4xx, and the
                    // client retried a permanent refusal for days.
                    Err(lost) => match replies.iter().find(|r: &&Reply| !r.is_positive()) {
                        Some(refusal) => {
                            self.broken = true;
                            return Err(RelayError::Refused(refusal.clone()));
                        }
                        None => return Err(lost),
                    },
                };
                let closing = reply.code == 421;
                replies.push(reply);
                if closing {
                    break;
                }
            }
            replies
        } else {
            let mut replies = vec![self.command(mail.as_bytes(), deadline).await?];
            if replies[0].is_positive() {
                for r in &rcpts {
                    let reply = self.command(r.as_bytes(), deadline).await?;
                    let refused = !reply.is_positive();
                    replies.push(reply);
                    if refused {
                        break;
                    }
                }
            }
            if replies.iter().all(Reply::is_positive) {
                replies.push(self.command(b"DATA\r\n", deadline).await?);
            }
            replies
        };
        let data_ok =
            replies.len() == rcpts.len() + 2 && replies.last().is_some_and(|r| r.code == 354);
        if let Some(refusal) = replies[..replies.len().min(rcpts.len() + 1)]
            .iter()
            .find(|r| !r.is_positive())
        {
            let refusal = refusal.clone();
            if data_ok {
                // The upstream waits for data for the recipients it took;
                // all or nothing: only closing the session takes it back
                // (RFC 2920 3.1), since an end of data would deliver.
                self.broken = true;
            } else if !self.broken {
                self.reset(deadline).await;
            }
            return Err(RelayError::Refused(refusal));
        }
        if !data_ok {
            let refusal = replies
                .last()
                .cloned()
                .unwrap_or(super::reply::UPSTREAM_LOST);
            if !self.broken {
                self.reset(deadline).await;
            }
            return Err(RelayError::Refused(refusal));
        }
        // The text first, then the end of data on its own: a client that
        // hangs up while the text is still going aborts the relay (the
        // upstream never sees the end of data), and only once the end of
        // data starts going is the message the upstream's to take.
        let mut stuffer = Stuffer::new(body);
        let mut piece = Vec::with_capacity(TEXT_PIECE + TEXT_PIECE / 16);
        // (An empty text has no piece: the end of data alone goes.)
        while stuffer.next_piece(TEXT_PIECE, &mut piece) {
            within(deadline, false, self.stream.write_all(&piece)).await?;
        }
        drop(piece);
        env.committed
            .store(true, std::sync::atomic::Ordering::Relaxed);
        // (Flushed: over TLS, the last record may still be in hand when
        // the socket was full.)
        within(deadline, true, async {
            self.stream.write_all(END_OF_DATA).await?;
            self.stream.flush().await
        })
        .await?;
        let reply = self.reply(deadline.max(env.reply_by), true).await?;
        match reply.code {
            200..300 => Ok(reply),
            400..600 => Err(RelayError::Refused(reply)),
            // 1xx or 3xx: out of step. Not a success (it was passed on
            // as one), and the message may have been taken.
            code => {
                self.broken = true;
                Err(RelayError::Lost {
                    after_dot: true,
                    why: format!("the upstream answered the end of data with {code}"),
                })
            }
        }
    }

    /// RSET after a refused transaction, so the session can take the next.
    async fn reset(&mut self, deadline: Instant) {
        match self.command(b"RSET\r\n", deadline).await {
            Ok(r) if r.is_positive() => {}
            _ => self.broken = true,
        }
    }

    /// Whether the session may take another message.
    pub fn reusable(&mut self, max_messages: u32, idle_timeout: Duration) -> bool {
        !self.broken
            && self.messages < max_messages
            && self.idle_since.elapsed() < idle_timeout
            && self.inbuf.is_empty()
            && !self.stream.closed_or_talking()
    }

    /// Say QUIT and close (bounded).
    pub async fn quit(mut self) {
        if self.broken {
            return;
        }
        let deadline = Instant::now() + QUIT_WAIT;
        let _ = self.command(b"QUIT\r\n", deadline).await;
        let _ = tokio::time::timeout(QUIT_WAIT, self.stream.shutdown()).await;
    }
}

/// The most of one reply line kept, its code included: RFC 5321
/// (4.5.3.1.5) allows 512 octets a line with its CRLF. Postfix's client
/// cuts longer ones too (at 2,048) and keeps their code.
const REPLY_LINE: usize = 510;

/// A reply's bytes parsed; one that cannot be is a lost session, after
/// the end of data when it answers it (the message may have been taken,
/// so it is never sent again). What smtp-proto reads (at most 4,096 bytes
/// of text) is made of it first ([`readable`]).
fn parse_reply(raw: &[u8], after_dot: bool) -> Result<Reply, RelayError> {
    let lost = |why: String| RelayError::Lost { after_dot, why };
    let readable = readable(raw).ok_or_else(|| {
        lost(
            "the upstream's reply has lines with different codes, or none (RFC 5321 4.2.1)"
                .to_owned(),
        )
    })?;
    let mut reply = smtp_proto::response::parser::ResponseReceiver::default()
        .parse(&mut readable.iter())
        .map(Reply::from_parsed)
        .map_err(|e| lost(format!("the upstream's reply cannot be parsed: {e:?}")))?;
    // smtp-proto keeps each part of an enhanced code in a byte, and a
    // detail past 255 (Microsoft's `5.7.606`, say) came out `5.7.255`.
    if reply.esc != [0; 3] {
        reply.esc = enhanced_code(&readable).unwrap_or(reply.esc);
    }
    Ok(reply)
}

/// A complete reply (lines up to one without `-` after its code) made
/// readable for smtp-proto, which reads 4,096 bytes of a reply at most
/// and takes its code from the first line: each line cut to
/// [`REPLY_LINE`] bytes, and as many lines as fit kept from the last
/// backwards (the last one carries the outcome: a long 250 to the end of
/// data taken for a lost session told the client to send the message
/// again). `None` when the lines' codes differ: RFC 5321 (4.2.1) has them
/// all the same, and a `250-` line over a `550` is no reply to act on
/// either way.
fn readable(raw: &[u8]) -> Option<Vec<u8>> {
    const MOST: usize = smtp_proto::response::parser::MAX_RESPONSE_LENGTH;
    let lines: Vec<&[u8]> = raw.split_inclusive(|&b| b == b'\n').collect();
    let code = lines.last()?.get(..3)?;
    if lines.iter().any(|line| line.get(..3) != Some(code)) {
        return None;
    }
    let mut kept = Vec::new();
    let mut total = 0;
    for line in lines.iter().rev() {
        let line = line.strip_suffix(b"\n").unwrap_or(line);
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let line = line.get(..REPLY_LINE).unwrap_or(line);
        if total + line.len() + 2 > MOST {
            break;
        }
        total += line.len() + 2;
        kept.push(line);
    }
    let mut out = Vec::with_capacity(total);
    for line in kept.iter().rev() {
        out.extend_from_slice(line);
        out.extend_from_slice(b"\r\n");
    }
    Some(out)
}

/// A message's header section: up to its first empty line.
fn header_section(message: &[u8]) -> &[u8] {
    let end = message
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(message.len(), |i| i + 4);
    &message[..end]
}

/// The enhanced status code of a reply's first line (RFC 3463: `class.
/// subject.detail`, each part of one to three digits), as the line has it.
fn enhanced_code(raw: &[u8]) -> Option<[u16; 3]> {
    let line = raw.get(4..)?;
    let end = line
        .iter()
        .position(|b| matches!(b, b' ' | b'\r' | b'\n'))?;
    let mut esc = [0u16; 3];
    let mut parts = line[..end].split(|&b| b == b'.');
    for part in &mut esc {
        let digits = parts.next()?;
        if digits.is_empty() || digits.len() > 3 || !digits.iter().all(u8::is_ascii_digit) {
            return None;
        }
        *part = digits.iter().fold(0, |n, d| n * 10 + u16::from(d - b'0'));
    }
    parts.next().is_none().then_some(esc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_is_read_by_its_last_line_whatever_its_length() {
        let mut raw = Vec::new();
        for i in 0..100 {
            raw.extend_from_slice(
                format!("250-2.0.0 policy line {i} {}\r\n", "x".repeat(60)).as_bytes(),
            );
        }
        raw.extend_from_slice(b"250 2.0.0 Ok: queued as ABC\r\n");
        assert!(raw.len() > 4096);
        let reply = parse_reply(&raw, true).expect("taken");
        assert_eq!(reply.code, 250);
        assert_eq!(reply.esc, [2, 0, 0]);
        assert!(reply.text.contains("queued as ABC"), "{}", reply.text);
        // A short one is parsed whole, as before.
        let reply = parse_reply(b"550-5.7.1 no\r\n550 5.7.1 really\r\n", true).expect("parsed");
        assert_eq!((reply.code, reply.text.lines().count()), (550, 2));
        assert!(parse_reply(b"garbage\r\n", true).is_err());
        // A long reply whose last line's code differs from its first is
        // not trusted; nor a short one that cannot be parsed.
        let mut mixed = raw.clone();
        mixed[..3].copy_from_slice(b"550");
        assert!(parse_reply(&mixed, true).is_err());
        assert!(parse_reply(b"xyz-junk\r\n250 ok\r\n", true).is_err());
        // Nor a short one: smtp-proto took its first line's code, and this
        // was a 250 for a refusal.
        assert!(matches!(
            parse_reply(b"250-2.0.0 Ok\r\n550 5.7.1 Rejected\r\n", true),
            Err(RelayError::Lost {
                after_dot: true,
                ..
            })
        ));
        // One line past what smtp-proto reads is cut, its code kept: it
        // was a lost session, and the client sent the message again.
        let long = format!("250 2.0.0 Ok: queued as X {}\r\n", "x".repeat(5_000));
        let reply = parse_reply(long.as_bytes(), true).expect("taken");
        assert_eq!((reply.code, reply.esc), (250, [2, 0, 0]));
        assert!(reply.text.starts_with("Ok: queued as X"), "{}", reply.text);
        assert!(reply.text.len() < REPLY_LINE, "{}", reply.text.len());
    }

    #[test]
    fn enhanced_codes_keep_details_past_255() {
        let reply = parse_reply(b"550 5.7.606 Access denied\r\n", false).expect("parsed");
        assert_eq!((reply.code, reply.esc), (550, [5, 7, 606]));
        assert_eq!(reply.text, "Access denied");
        let reply = parse_reply(b"451-4.7.500 Server busy\r\n451 4.7.500 later\r\n", false)
            .expect("parsed");
        assert_eq!(reply.esc, [4, 7, 500]);
        let reply = parse_reply(b"250 2.1.0 Ok\r\n", false).expect("parsed");
        assert_eq!(reply.esc, [2, 1, 0]);
        // No enhanced code: none made up.
        let reply = parse_reply(b"250 Ok\r\n", false).expect("parsed");
        assert_eq!(reply.esc, [0, 0, 0]);
        assert_eq!(enhanced_code(b"550 5.7.6066 x\r\n"), None);
        assert_eq!(enhanced_code(b"550 5.7\r\n"), None);
    }

    /// The text as `send` writes it, in pieces of `piece` bytes, then the
    /// end of data.
    fn stuffed_in(body: &[u8], piece: usize) -> Vec<u8> {
        let mut out = Vec::new();
        let mut stuffer = Stuffer::new(body);
        let mut next = Vec::new();
        while stuffer.next_piece(piece, &mut next) {
            out.extend_from_slice(&next);
        }
        out.extend_from_slice(END_OF_DATA);
        out
    }

    fn stuffed(body: &[u8]) -> Vec<u8> {
        let whole = stuffed_in(body, TEXT_PIECE);
        // Pieces of any size give the same bytes: a line start is carried
        // from one to the next.
        for piece in 1..=4 {
            assert_eq!(stuffed_in(body, piece), whole, "pieces of {piece}");
        }
        whole
    }

    #[test]
    fn dots_are_doubled_at_every_line_start_and_the_end_is_added() {
        assert_eq!(stuffed(b""), b".\r\n");
        assert_eq!(stuffed(b"a\r\n"), b"a\r\n.\r\n");
        assert_eq!(stuffed(b".a\r\n.\r\nb"), b"..a\r\n..\r\nb\r\n.\r\n");
        // A bare LF or CR starts a line too: no end of data hides behind it.
        assert_eq!(stuffed(b"x\n.\nY\r.\r"), b"x\n..\nY\r..\r\r\n.\r\n");
    }

    #[test]
    fn local_parts_that_are_not_atoms_are_quoted() {
        assert_eq!(path(""), "<>");
        assert_eq!(path("a.b+c@x.org"), "<a.b+c@x.org>");
        assert_eq!(path("john doe@x.org"), "<\"john doe\"@x.org>");
        assert_eq!(path("a\"b@x.org"), "<\"a\\\"b\"@x.org>");
        assert_eq!(path(".a@x.org"), "<\".a\"@x.org>");
        assert_eq!(path("postmaster"), "<postmaster>");
        assert_eq!(path("ü@x.org"), "<ü@x.org>");
    }

    #[test]
    fn an_unreadable_answer_to_the_end_of_data_is_not_retried() {
        let after = parse_reply(b"250OK\r\n", true);
        assert!(matches!(
            after,
            Err(RelayError::Lost {
                after_dot: true,
                ..
            })
        ));
        assert!(after.is_err_and(|e| !e.stale_session(true)));
        let before = parse_reply(b"250OK\r\n", false);
        assert!(before.is_err_and(|e| e.stale_session(false)));
        assert!(parse_reply(b"250 Ok\r\n", true).is_ok());
    }

    #[test]
    fn a_reply_is_complete_at_its_last_line() {
        assert_eq!(complete_reply(b"250-a\r\n250-b\r\n"), None);
        assert_eq!(complete_reply(b"250-a\r\n250 b\r\n354 go\r\n"), Some(14));
        assert_eq!(complete_reply(b"250\r\n"), Some(5));
        assert_eq!(complete_reply(b"250 partial"), None);
    }

    #[test]
    fn only_a_stale_session_is_retried() {
        let lost = |after_dot| RelayError::Lost {
            after_dot,
            why: String::new(),
        };
        assert!(lost(false).stale_session(false));
        assert!(!lost(true).stale_session(true));
        let r = |code| Reply::owned(code, [4, 0, 0], String::new());
        assert!(RelayError::Refused(r(421)).stale_session(false));
        // A 421 to the end of data: the message went, once.
        assert!(!RelayError::Refused(r(421)).stale_session(true));
        assert!(!RelayError::Refused(r(451)).stale_session(false));
    }
}
