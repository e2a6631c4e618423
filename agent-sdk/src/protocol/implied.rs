//! What a subject implies of an envelope's addressing (protocol 2 leaves it out of the
//! envelope); [`crate::Subjects::implied`] reads it off a subject.

/// What a subject carries of an envelope's addressing: the compact envelope (protocol 2)
/// leaves these fields out when they equal the subject's, and a receiver fills them back in
/// from the subject ([`Implied::restore`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Implied<'a> {
    /// The recipient, of `<root>.agent.<agent>.<command>` and `<root>.inbox.<agent>.<lane>.<command>`.
    pub agent: Option<&'a str>,
    /// The command name, of the same two.
    pub name: Option<&'a str>,
    /// The topic, of `<root>.evt.<topic>`.
    pub topic: Option<&'a str>,
    /// The capability, of `<root>.cap.<capability>`.
    pub capability: Option<&'a str>,
}

impl Implied<'_> {
    /// Fills the fields `env` left out with the subject's.
    pub fn restore(&self, env: &mut super::envelope::Envelope) {
        if let (true, Some(agent)) = (env.to.is_empty(), self.agent) {
            env.to = vec![agent.to_owned()];
        }
        if let (None, Some(name)) = (&env.name, self.name) {
            env.name = Some(name.to_owned());
        }
        if let (None, Some(topic)) = (&env.topic, self.topic) {
            env.topic = Some(topic.into());
        }
        if let (None, Some(capability)) = (&env.capability, self.capability) {
            env.capability = Some(capability.to_owned());
        }
    }
}
